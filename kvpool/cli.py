"""The ``kvpool`` command: check a pool, and run what the installed components register.

``health`` and ``info`` need only the client. ``serve``, ``demo``, ``worker`` and ``bench`` belong to the pool
manager, the workers and the benchmarks: each registers a :class:`Command` under the ``kvpool.commands`` entry
point group, so this module names none of them and imports a component only when its command runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

GROUP = "kvpool.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand a component offers: its one-line help, and ``module:function`` taking the rest of the line."""

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


def _health(args: argparse.Namespace) -> int:
    import httpx

    from kvpool.address import default_url
    from kvpool.client import http_client

    url = args.url or default_url()
    try:
        with http_client(url, None, args.timeout) as http:
            r = http.get("/health")
    except httpx.HTTPError as exc:
        print(f"unreachable: {url}: {exc}", file=sys.stderr)
        return 1
    print(r.text)
    return 0 if r.status_code == 200 else 1


def _info(args: argparse.Namespace) -> int:
    from kvpool.address import default_url
    from kvpool.client import http_client, raise_for

    with http_client(args.url or default_url(), args.token, 10.0) as http:
        out = {}
        for path in ("/arena", "/stats"):
            r = http.get(path)
            if r.status_code != 200:
                raise_for(r.status_code, r.content)
            out[path.strip("/")] = r.json()
    if "handle" in out["arena"] and not args.show_handle:
        out["arena"]["handle"] = "<hidden: --show-handle>"
    print(json.dumps(out, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = registered()
    # Registered commands own their flags: they get the rest of the line untouched.
    if argv and argv[0] in commands:
        return commands[argv[0]].run(argv[1:])

    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in commands.items():
        sub.add_parser(name, help=command.help)
    health = sub.add_parser("health", help="exit 0 if the pool answers /health with 200")
    health.add_argument("--url", default=None, help="pool URL [env KVPOOL_URL]")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)
    info = sub.add_parser("info", help="print the arena descriptor and the pool's stats")
    info.add_argument("--url", default=None, help="pool URL [env KVPOOL_URL]")
    info.add_argument("--token", default=None)
    info.add_argument("--show-handle", action="store_true", help="print the arena handle (a secret)")
    info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
