"""The ``kvpool`` command: serve the pool, check it, run the demo, the workers and the benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvpool.config import PoolSettings, add_settings_arguments, settings_from_args


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from server.main import serve

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvpool serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


def _health(args: argparse.Namespace) -> int:
    import httpx

    from kvpool.client import default_url, http_client
    from kvpool.errors import UntrustedSocket

    url = args.url or default_url()
    try:
        with http_client(url, None, args.timeout) as http:
            r = http.get("/health")
    except httpx.HTTPError as exc:
        print(f"unreachable: {url}: {exc}", file=sys.stderr)
        return 1
    except UntrustedSocket as exc:
        print(f"kvpool health: {exc}", file=sys.stderr)
        return 1
    print(r.text)
    return 0 if r.status_code == 200 else 1


def _info(args: argparse.Namespace) -> int:
    from kvpool.client import default_url, http_client, raise_for
    from kvpool.errors import UntrustedSocket

    try:
        http = http_client(args.url or default_url(), args.token, 10.0)
    except UntrustedSocket as exc:
        print(f"kvpool info: {exc}", file=sys.stderr)
        return 1
    with http:
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


def _delegate(module: str, argv: Sequence[str]) -> int:
    import importlib

    result = importlib.import_module(module).main(list(argv))
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands that own their flags get the rest of the line untouched.
    delegates = {"demo": "workers.demo", "bench": "benchmarks.__main__"}
    if argv and argv[0] in delegates:
        return _delegate(delegates[argv[0]], argv[1:])
    if len(argv) >= 2 and argv[0] == "worker" and argv[1] in {"prefill", "decode"}:
        return _delegate(f"workers.{argv[1]}", argv[2:])

    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the pool manager (flags override KVPOOL_* variables)")
    add_settings_arguments(serve, PoolSettings)
    serve.set_defaults(func=_serve)
    health = sub.add_parser("health", help="exit 0 if the pool answers /health with 200")
    health.add_argument("--url", default=None, help="pool URL [env KVPOOL_URL]")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)
    info = sub.add_parser("info", help="print the arena descriptor and the pool's stats")
    info.add_argument("--url", default=None, help="pool URL [env KVPOOL_URL]")
    info.add_argument("--token", default=None)
    info.add_argument("--show-handle", action="store_true", help="print the arena handle (a secret)")
    info.set_defaults(func=_info)
    sub.add_parser("demo", help="the whole prefill -> decode flow on this machine (see kvpool demo --help)")
    sub.add_parser("worker", help="run a worker: kvpool worker prefill|decode --help")
    sub.add_parser("bench", help="run a benchmark suite: kvpool bench --help")
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
