"""The subcommands of ``kvpool`` that components register, so that the command itself names none of them.

A component (the pool manager, the workers, the benchmarks) lists a :class:`Command` in its distribution's
``kvpool.commands`` entry points; the target is imported only when its command runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

GROUP = "kvpool.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, and ``module:function`` that takes the rest of the command line."""

    help: str
    target: str

    def run(self, argv: list[str]) -> int:
        module, _, func = self.target.partition(":")
        main: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), func)
        return int(main(argv) or 0)


def registered() -> dict[str, Command]:
    found: dict[str, Command] = {}
    for ep in entry_points(group=GROUP):
        command = ep.load()
        if isinstance(command, Command):
            found[ep.name] = command
    return found
