"""The workers' subcommands of ``kvpool`` (registered as entry points; import nothing heavy)."""

from __future__ import annotations

import sys

from kvpool.commands import Command

demo = Command("the whole prefill -> decode flow on this machine (see kvpool demo --help)", "kvpool.workers.demo:main")
worker = Command("run a worker: kvpool worker prefill|decode --help", "kvpool.workers.commands:worker_main")

ROLES = ("prefill", "decode")


def worker_main(argv: list[str]) -> int:
    if not argv or argv[0] not in ROLES:
        print(f"usage: kvpool worker {{{','.join(ROLES)}}} [options]  (kvpool worker prefill --help)", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    return Command("", f"kvpool.workers.{argv[0]}:main").run(argv[1:])
