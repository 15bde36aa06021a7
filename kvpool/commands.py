"""The subcommands of ``kvpool`` that components register, so that the command itself names none of them.

A component (the pool manager, the workers, the benchmarks) lists a :class:`Command` in its distribution's
``kvpool.commands`` entry points; the target is imported only when its command runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import NoReturn

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


class Parser(argparse.ArgumentParser):
    """argparse, saying a mistake in two lines: what was wrong (with the values allowed, when there is a list) and
    where the options are. argparse's own prints the whole usage first, which buries the one line that matters
    (36 lines for ``kvpool serve --dtype int4``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n{self.prog} --help lists the options\n")
