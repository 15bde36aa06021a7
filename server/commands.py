"""The pool manager's subcommand of ``kvpool`` (registered as an entry point; imports nothing heavy)."""

from kvpool.commands import Command

serve = Command("run the pool manager (flags override KVPOOL_* variables)", "kvpool.server.main:main")
