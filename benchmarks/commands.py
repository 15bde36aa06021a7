"""The benchmarks' subcommand of ``kvpool`` (registered as an entry point; imports nothing heavy)."""

from kvpool.commands import Command

bench = Command("run a benchmark suite: kvpool bench --help", "kvpool.benchmarks.__main__:main")
