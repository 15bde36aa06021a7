"""The ``kvpool`` command: check a pool, and run what the installed components register.

``health`` and ``info`` need only the client. ``serve``, ``demo``, ``worker`` and ``bench`` belong to the pool
manager, the workers and the benchmarks: each registers a :class:`Command` under the ``kvpool.commands`` entry
point group, so this module names none of them and imports a component only when its command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvpool.commands import Command, Parser, registered

HIDDEN = "<hidden: --show-handle>"


def package_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _health(args: argparse.Namespace) -> int:
    from kvpool.transport import http_client

    with http_client(args.url, None, args.timeout) as http:
        r = http.get("/health")
    print(r.text)
    return 0 if r.status_code == 200 else 1


def hide_handles(arena: dict[str, Any]) -> dict[str, Any]:
    """The descriptor with every arena's handle replaced: whoever reads it could map the whole arena."""
    out = {**arena}
    if "handle" in out:
        out["handle"] = HIDDEN
    if isinstance(out.get("arenas"), list):
        out["arenas"] = [{**part, "handle": HIDDEN} if "handle" in part else part for part in out["arenas"]]
    return out


def _info(args: argparse.Namespace) -> int:
    from kvpool.errors import raise_for
    from kvpool.transport import http_client

    with http_client(args.url, args.token, 10.0) as http:
        out = {}
        for path in ("/arena", "/stats"):
            r = http.get(path)
            if r.status_code != 200:
                raise_for(r.status_code, r.content)
            out[path.strip("/")] = r.json()
    if not args.show_handle:
        out["arena"] = hide_handles(out["arena"])
    print(json.dumps(out, indent=2))
    return 0


def one_line(command: str, exc: BaseException, url: str | None, token: str | None) -> str:
    """What went wrong, and what to do about it, for the errors a user meets before anything works."""
    import httpx

    from kvpool.errors import Unauthorized

    if isinstance(exc, httpx.TransportError):
        where = url or "the pool"
        return (
            f"{command}: no pool answers at {where} ({type(exc).__name__}): start one with 'kvpool serve', or "
            "point --url (or KVPOOL_URL) at the one that runs"
        )
    if isinstance(exc, Unauthorized):
        if token:
            return f"{command}: the pool refused the token: pass the one it was started with (--token or KVPOOL_TOKEN)"
        return f"{command}: the pool wants a token: pass --token or set KVPOOL_TOKEN"
    return f"{command}: {exc}"


def run(
    command: str, func: Callable[..., int | None], *args: Any, url: str | None = None, token: str | None = None
) -> int:
    """Run a subcommand; the errors kvpool raises on purpose, and an absent pool, are one line and exit 1."""
    import httpx

    from kvpool.errors import KvpoolError

    try:
        return int(func(*args) or 0)
    except (KvpoolError, httpx.TransportError) as exc:
        print(one_line(command, exc, url, token), file=sys.stderr)
        return 1


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    from kvpool.address import default_url

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = Parser(
        prog="kvpool", description="A node-local KV-cache pool: serve it, check it, run its workers and benchmarks."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in commands.items():
        sub.add_parser(name, help=command.help)
    url_help = "pool URL: unix:///path/kvpool.sock or http://host:port (env KVPOOL_URL)"
    health = sub.add_parser("health", help="exit 0 if the pool answers /health with 200", formatter_class=formatter)
    health.add_argument("--url", default=default_url(), help=url_help)
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    health.set_defaults(func=_health)
    info = sub.add_parser("info", help="print the arena descriptor and the pool's stats", formatter_class=formatter)
    info.add_argument("--url", default=default_url(), help=url_help)
    info.add_argument("--token", default=argparse.SUPPRESS, help="the pool's bearer token (env KVPOOL_TOKEN)")
    info.add_argument("--show-handle", action="store_true", help="print the arena handles (a secret)")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = registered()
    # Registered commands own their flags: they get the rest of the line untouched.
    if argv and argv[0] in commands:
        words = argv[:2] if len(argv) > 1 and not argv[1].startswith("-") else argv[:1]  # "kvpool worker prefill"
        return run(" ".join(["kvpool", *words]), commands[argv[0]].run, argv[1:])
    args = build_parser(commands).parse_args(argv)
    if args.command == "info" and not getattr(args, "token", None):
        args.token = os.environ.get("KVPOOL_TOKEN") or None
    url, token = getattr(args, "url", None), getattr(args, "token", None)
    return run(f"kvpool {args.command}", args.func, args, url=url, token=token)


if __name__ == "__main__":
    raise SystemExit(main())
