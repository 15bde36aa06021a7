"""The ``kvpool`` command: serve the pool, check it, run the demo, the workers and the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvpool.config import PoolSettings, add_settings_arguments, describe_error, settings_from_args

HIDDEN = "<hidden: --show-handle>"


def package_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvpool serve: invalid settings: {describe_error(exc)}", file=sys.stderr)
        return 2
    from server.main import serve

    serve(settings)
    return 0


def _health(args: argparse.Namespace) -> int:
    from kvpool.client import http_client

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
    from kvpool.client import http_client, raise_for

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


def _run(command: str, func: Any, *args: Any, url: str | None = None, token: str | None = None) -> int:
    """Run a subcommand; the errors kvpool raises on purpose, and an absent pool, are one line and exit 1."""
    import httpx

    from kvpool.errors import KvpoolError

    try:
        return int(func(*args) or 0)
    except (KvpoolError, httpx.TransportError) as exc:
        print(one_line(command, exc, url, token), file=sys.stderr)
        return 1


def _delegate(module: str, argv: Sequence[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    from kvpool.client import default_url

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpool {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the pool manager",
        description="Run the pool manager until SIGINT or SIGTERM. Every flag is also a KVPOOL_* variable; "
        "flags win over variables.",
    )
    add_settings_arguments(serve, PoolSettings)
    serve.set_defaults(func=_serve)

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
    sub.add_parser("demo", help="the whole prefill -> decode flow on this machine (kvpool demo --help)")
    sub.add_parser("worker", help="run a worker: kvpool worker prefill|decode --help")
    sub.add_parser("bench", help="run a benchmark suite: kvpool bench --help")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands that own their flags get the rest of the line untouched.
    delegates = {"demo": "workers.demo", "bench": "benchmarks.__main__"}
    if argv and argv[0] in delegates:
        return _run(f"kvpool {argv[0]}", _delegate, delegates[argv[0]], argv[1:])
    if len(argv) >= 2 and argv[0] == "worker" and argv[1] in {"prefill", "decode"}:
        return _run(f"kvpool worker {argv[1]}", _delegate, f"workers.{argv[1]}", argv[2:])
    args = build_parser().parse_args(argv)
    if args.command == "info" and not getattr(args, "token", None):
        args.token = os.environ.get("KVPOOL_TOKEN") or None
    url, token = getattr(args, "url", None), getattr(args, "token", None)
    return _run(f"kvpool {args.command}", args.func, args, url=url, token=token)


if __name__ == "__main__":
    raise SystemExit(main())
