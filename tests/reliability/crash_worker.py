"""A worker that takes every kind of ref the pool hands out, reports them, and waits to be killed.

Run as ``python -m tests.reliability.crash_worker URL PREFIX_JSON [--no-fast] [--handoff-ttl-s S]``. It allocates
blocks and writes into them, takes prefix refs with a lookup, parks a handoff, starts a claim that will wait,
then prints one JSON line with what it holds and sleeps until a signal ends it. Killed with SIGKILL, it never
frees, closes or heartbeats again: only the pool's leases can get its blocks back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time

import torch  # noqa: F401 - imported before the session opens: a multi-second import can starve the heartbeat

from kvpool.client import PoolClient
from kvpool.errors import KvpoolError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("prefix", help="JSON list of token ids whose blocks another session committed")
    parser.add_argument("--name", default="doomed")
    parser.add_argument("--no-fast", action="store_true")
    parser.add_argument("--handoff-ttl-s", type=float, default=None, help="per-handoff ttl (default: the pool's)")
    args = parser.parse_args(argv)

    client = PoolClient(args.url, name=args.name, role="prefill", fast=not args.no_fast)
    arena = client.arena()
    owned = client.alloc(3)
    for block in owned:
        arena.k(0)[block].fill_(float(block))
    hit = client.lookup(json.loads(args.prefix))
    parked = client.alloc(2)
    request_id = f"{args.name}-request"
    client.handoff(request_id, parked, num_tokens=len(parked), meta={"from": args.name}, ttl_s=args.handoff_ttl_s)

    def wait_for_claim() -> None:
        with contextlib.suppress(KvpoolError):
            client.claim(f"{args.name}-never", timeout_s=60)

    threading.Thread(target=wait_for_claim, daemon=True).start()
    time.sleep(0.2)  # let the claim reach the pool and start waiting there
    report = {
        "session_id": client.session_id,
        "owned": owned,
        "hit": hit.block_ids,
        "parked": parked,
        "request_id": request_id,
        "fast": client.transport.fast_path is not None,
    }
    print(json.dumps(report), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
