"""The prefill worker: computes prompts' KV straight into the pool's arena and hands them over by block ids.

For each request (JSON lines on stdin or ``--requests FILE``):

1. ``lookup(prompt[:-1])``: the longest cached prefix, in whole blocks. The last prompt token is always left out,
   so at least one token is computed and gives the logits the first output token is sampled from.
2. ``alloc`` the blocks the rest of the prompt needs (waiting a while if the pool is full: decode frees blocks).
3. Run the forward pass over the uncached tokens; every layer writes K and V into the arena slots of the block
   table and reads the cached prefix from the blocks the lookup returned.
4. Wait for this process's CUDA stream (see :func:`workers.cli.synchronize`), then ``commit`` the prompt's full
   blocks (they become prefix hits for later prompts) and ``handoff`` the request: block ids, the number of
   tokens whose KV they hold, and :class:`workers.request.HandoffMeta`. With ``--handoff-to NAME`` the handoff
   is addressed to that decode worker, and its ids go to the worker's inbox directly.

It prints one JSON line per request: tokens hit in the cache and computed here, the first token, timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence

from kvpool.workers.cli import (
    add_model_arguments,
    add_pool_arguments,
    connect,
    emit,
    load_model,
    setup,
    synchronize,
)
from kvpool.workers.model import KVCaches, LlamaModel
from kvpool.workers.request import GenerationRequest, HandoffMeta
from kvpool.workers.sequence import blocks_needed, greedy

from kvpool.client import DeviceSession, PoolClient
from kvpool.errors import KvpoolError, PoolExhausted


def alloc_waiting(pool: DeviceSession, num_blocks: int, timeout_s: float) -> list[int]:
    """``alloc``, retried with backoff while the pool is exhausted: decode frees blocks as requests end."""
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        try:
            return pool.alloc(num_blocks)
        except PoolExhausted:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.1)


class PrefillWorker:
    """Runs requests one at a time against one pool session and one mapped arena."""

    def __init__(
        self,
        pool: DeviceSession,
        model: LlamaModel,
        kv_caches: KVCaches,
        block_size: int,
        alloc_timeout_s: float,
        handoff_to: str | None = None,
    ) -> None:
        self.pool = pool
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.alloc_timeout_s = alloc_timeout_s
        self.handoff_to = handoff_to

    def run(self, req: GenerationRequest) -> dict[str, object]:
        arrived = time.time()
        t0 = time.perf_counter()
        prompt = req.prompt
        hit = self.pool.lookup(prompt[:-1])
        blocks = list(hit.block_ids)
        try:
            blocks += alloc_waiting(
                self.pool, blocks_needed(len(prompt), self.block_size) - len(blocks), self.alloc_timeout_s
            )
            t1 = time.perf_counter()
            logits = self.model.prefill(prompt, blocks, hit.num_tokens, self.kv_caches)
            first = greedy(logits[None])[0]
            synchronize(self.model.device)  # the KV writes are done before any other process hears of them
            t2 = time.perf_counter()
            self.pool.commit(blocks, prompt)
            meta = HandoffMeta(
                prompt_len=len(prompt),
                first_token=first,
                max_new_tokens=req.max_new_tokens,
                arrived_at=arrived,
                handed_off_at=time.time(),
                computed_tokens=len(prompt) - hit.num_tokens,
                hit_tokens=hit.num_tokens,
            )
            self.pool.handoff(req.request_id, blocks, len(prompt), meta=meta.to_dict(), to=self.handoff_to)
        except BaseException:
            with contextlib.suppress(KvpoolError):
                self.pool.free(blocks)  # the lookup's refs and the fresh blocks: nothing leaks on a failure
            raise
        t3 = time.perf_counter()
        return {
            "request_id": req.request_id,
            "prompt_len": len(prompt),
            "hit_tokens": hit.num_tokens,
            "computed_tokens": len(prompt) - hit.num_tokens,
            "num_blocks": len(blocks),
            "first_token": first,
            "forward_ms": round(1e3 * (t2 - t1), 3),
            "total_ms": round(1e3 * (t3 - t0), 3),
        }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpool worker prefill", description=__doc__.split("\n\n")[0])
    add_pool_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--requests", type=argparse.FileType("r"), default=None, help="JSON lines (default stdin)")
    parser.add_argument(
        "--alloc-timeout-s", type=float, default=30.0, help="how long to wait for blocks when the pool is full"
    )
    parser.add_argument(
        "--handoff-to",
        default=None,
        metavar="NAME",
        help="address every handoff to the decode worker of this session name (its ids then go to it directly)",
    )
    return parser.parse_args(argv)


def wait_for_session(pool: PoolClient, name: str, timeout_s: float) -> None:
    """Wait until the pool has exactly one live session called ``name``: a handoff addressed to it needs it up."""
    deadline = time.monotonic() + timeout_s
    while len(pool.sessions(name)) != 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"no single live session named {name!r} after {timeout_s}s: start its decode worker")
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup(args)
    stream = args.requests or sys.stdin
    failures = 0
    with connect(args, "prefill") as pool:
        layout = pool.descriptor().layout
        blocks = DeviceSession(pool, args.device, layout)
        arena = blocks.arena
        model = load_model(args, layout, arena.device)
        if args.handoff_to is not None:
            wait_for_session(pool, args.handoff_to, args.alloc_timeout_s)
        worker = PrefillWorker(
            blocks, model, arena.kv_caches(), layout.block_size, args.alloc_timeout_s, args.handoff_to
        )
        for line in stream:
            if not line.strip():
                continue
            try:
                req = GenerationRequest.from_json(line)
                emit(worker.run(req))
            except (KvpoolError, ValueError, KeyError, TypeError) as exc:
                failures += 1
                emit({"request_id": _request_id(line), "error": f"{type(exc).__name__}: {exc}"})
    return 1 if failures else 0


def _request_id(line: str) -> str | None:
    try:
        return str(json.loads(line)["request_id"])
    except (ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
