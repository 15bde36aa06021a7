"""The prefill worker: computes prompts' KV straight into the pool's arena and hands them over by block ids.

Requests (JSON lines on stdin or ``--requests FILE``) are read as they come, by a thread, and prefilled in
batches (:mod:`workers.batching`):

1. Admit: ``lookup(prompt[:-1])``, the longest cached prefix in whole blocks (the last prompt token is always
   left out, so at least one token is computed and gives the logits the first output token is sampled from),
   then ``alloc`` the blocks the rest of the prompt needs. A request that does not fit waits: decode frees blocks.
2. Step: one forward over the new tokens of the admitted requests, packed, at most ``--token-budget`` of them (a
   longer prompt goes in chunks over several steps). Every layer writes K and V into the arena slots of each
   block table and reads the cached prefix from the blocks the lookup returned.
3. For the requests the step finished: wait for this process's CUDA stream (see :func:`workers.cli.synchronize`),
   then ``commit`` the prompt's full blocks (they become prefix hits for later prompts) and ``handoff`` the
   request: block ids, the number of tokens whose KV they hold, and :class:`workers.request.HandoffMeta`. With
   ``--handoff-to NAME`` the handoff is addressed to that decode worker, and its ids go to its inbox directly.

It prints one JSON line per request: tokens hit in the cache and computed here, the first token, timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvpool.client import PoolClient
from kvpool.devices import DeviceSession
from kvpool.errors import KvpoolError
from kvpool.workers.batching import PrefillBatcher, Prefilling
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
from kvpool.workers.request import GenerationRequest, HandoffMeta, check_tokens
from kvpool.workers.sequence import blocks_needed


class PrefillWorker:
    """Prefills the requests given to :meth:`submit` in batched, chunked steps, and hands each off when done."""

    def __init__(
        self,
        pool: DeviceSession,
        model: LlamaModel,
        kv_caches: KVCaches,
        block_size: int,
        alloc_timeout_s: float,
        handoff_to: str | None = None,
        token_budget: int = 4096,
        max_running: int = 64,
        push_to: int | None = None,
    ) -> None:
        self.pool = pool
        self.model = model
        self.alloc_timeout_s = alloc_timeout_s
        self.handoff_to = handoff_to
        self.push_to = push_to
        self.batcher = PrefillBatcher(model, kv_caches, pool, block_size, token_budget, max_running)

    def submit(self, req: GenerationRequest, arrived_at: float | None = None) -> None:
        """Queue ``req``; a ValueError, and nothing queued, if the model cannot embed one of its tokens."""
        check_tokens(req.request_id, req.prompt, self.model.config.vocab_size)
        self.batcher.add(req, arrived_at)

    @property
    def idle(self) -> bool:
        return self.batcher.idle

    def work(self) -> list[dict[str, object]]:
        """Admit what fits, run one step, hand off the requests it finished; their records (errors included)."""
        b = self.batcher
        b.admit()
        if not b.running:
            return self._give_up_waiting()
        t0 = time.perf_counter()
        try:
            finished = b.step()
            if finished:
                synchronize(self.model.device)  # the KV writes are done before any other process hears of them
        except BaseException:
            with contextlib.suppress(KvpoolError):
                b.fail_all()  # the lookups' refs and the fresh blocks: nothing leaks on a failure
            raise
        step_ms = round(1e3 * (time.perf_counter() - t0), 3)
        b.release(finished)
        return self._hand_off(finished, step_ms)

    def _hand_off(self, finished: list[Prefilling], step_ms: float) -> list[dict[str, object]]:
        """Commit each finished prompt's blocks, then hand it off (after one copy for all of them, pushing)."""
        records: dict[int, dict[str, object]] = {}
        ready: list[Prefilling] = []
        for p in finished:
            try:
                self.pool.commit(p.block_ids, p.request.prompt, p.request.salt)
                ready.append(p)
            except KvpoolError as exc:
                records[id(p)] = self._failed(p, exc, self.pool.free, p.block_ids)
        # the ids to hand off, and the client that speaks them: this device's (local ids), or the pool's (global)
        ids: list[Sequence[int]] = [p.block_ids for p in ready]
        client: DeviceSession | PoolClient = self.pool
        if self.push_to is not None and ready:
            try:
                ids = self._push(ids)
                client = self.pool.pool
            except KvpoolError as exc:
                for p in ready:
                    records[id(p)] = self._failed(p, exc, self.pool.free, p.block_ids)
                ready = []
        for p, held in zip(ready, ids, strict=False):
            req, prompt = p.request, p.request.prompt
            assert p.first_token is not None
            meta = HandoffMeta(
                prompt_len=len(prompt),
                first_token=p.first_token,
                max_new_tokens=req.max_new_tokens,
                arrived_at=p.arrived_at,
                handed_off_at=time.time(),
                computed_tokens=len(prompt) - p.hit_tokens,
                hit_tokens=p.hit_tokens,
                salt=req.salt,
            )
            try:
                client.handoff(req.request_id, held, len(prompt), meta=meta.to_dict(), to=self.handoff_to)
            except KvpoolError as exc:
                records[id(p)] = self._failed(p, exc, client.free, held)
                continue
            records[id(p)] = {
                "request_id": req.request_id,
                "prompt_len": len(prompt),
                "hit_tokens": p.hit_tokens,
                "computed_tokens": len(prompt) - p.hit_tokens,
                "num_blocks": len(held),
                "first_token": p.first_token,
                "batch": len(finished),
                "forward_ms": step_ms,
                "total_ms": round(1e3 * (time.time() - p.arrived_at), 3),
            }
        return [records[id(p)] for p in finished]

    @staticmethod
    def _failed(p: Prefilling, exc: KvpoolError, free: Callable[[Sequence[int]], object], held: Sequence[int]) -> dict:
        with contextlib.suppress(KvpoolError):
            free(held)  # nothing leaks on a failure
        return {"request_id": p.request.request_id, "error": f"{type(exc).__name__}: {exc}"}

    def _push(self, tables: list[Sequence[int]]) -> list[list[int]]:
        """Copy the prompts' KV into ``push_to``'s arena in one go; the copies' global block ids, per prompt.

        The copy runs in this process, once per step: a gather on this GPU (queued behind the prefill's own
        kernels in one context, where a decode worker's claim-time copy would be a second process's kernel,
        time-sliced against them), a peer copy, a scatter on the other GPU, then one wait for it all. The
        originals are freed and stay cached here for prefix hits.
        """
        flat = self.pool.pool_ids([b for t in tables for b in t])
        moved = self.pool.pool.move(flat, device=self.push_to)  # type: ignore[arg-type]
        out, at = [], 0
        for t in tables:
            out.append(moved[at : at + len(t)])
            at += len(t)
        return out

    def _give_up_waiting(self) -> list[dict[str, object]]:
        """With nothing running, a request that still does not fit after ``alloc_timeout_s`` fails (the pool
        is full of other sessions' blocks); the ones behind it get their turn."""
        b = self.batcher
        if not b.waiting or time.time() - b.waiting[0].arrived_at < self.alloc_timeout_s:
            return []
        head = b.waiting.popleft()
        need = blocks_needed(len(head.request.prompt), b.block_size)
        why = f"no room for {need} blocks after {self.alloc_timeout_s}s: free blocks or start the pool larger"
        return [{"request_id": head.request.request_id, "error": f"PoolExhausted: {why}"}]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpool worker prefill", description=__doc__.split("\n\n")[0])
    add_pool_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--requests", type=argparse.FileType("r"), default=None, help="JSON lines (default stdin)")
    parser.add_argument(
        "--alloc-timeout-s", type=float, default=30.0, help="how long to wait for blocks when the pool is full"
    )
    parser.add_argument(
        "--token-budget", type=int, default=4096, help="most prompt tokens computed in one forward (longer: chunks)"
    )
    parser.add_argument("--max-running", type=int, default=64, help="most requests being prefilled at once")
    parser.add_argument(
        "--push-to",
        type=int,
        default=None,
        metavar="DEVICE",
        help="copy each prompt's KV into DEVICE's arena before the handoff (a decode worker there reads it in place)",
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


def _read(stream: Iterable[str], inbox: queue.Queue[tuple[float, str] | None]) -> None:
    for line in stream:
        if line.strip():
            inbox.put((time.time(), line))
    inbox.put(None)


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
            blocks, model, arena.kv_caches(), layout.block_size, args.alloc_timeout_s, args.handoff_to,
            args.token_budget, args.max_running, args.push_to,
        )  # fmt: skip
        inbox: queue.Queue[tuple[float, str] | None] = queue.Queue()
        threading.Thread(target=_read, args=(stream, inbox), name="prefill-requests", daemon=True).start()
        ended = False
        while not (ended and worker.idle):
            try:
                item = inbox.get(timeout=0.05) if worker.idle else inbox.get_nowait()
                while not ended:
                    if item is None:
                        ended = True
                        break
                    try:
                        worker.submit(GenerationRequest.from_json(item[1]), item[0])
                    except (ValueError, KeyError, TypeError) as exc:
                        failures += 1
                        emit({"request_id": _request_id(item[1]), "error": f"{type(exc).__name__}: {exc}"})
                    item = inbox.get_nowait()
            except queue.Empty:
                pass
            records = worker.work()
            for record in records:
                failures += "error" in record
                emit(record)
            if not records and not worker.batcher.running and worker.batcher.waiting:
                time.sleep(0.002)  # waiting for decode to free blocks
    return 1 if failures else 0


def _request_id(line: str) -> str | None:
    try:
        return str(json.loads(line)["request_id"])
    except (ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
