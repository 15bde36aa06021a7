"""The decode worker: claims handed-over requests and decodes them in batches, reading KV from the arena.

The loop, until ``--num-requests`` requests have finished or a stop signal (SIGINT/SIGTERM) arrives:

1. Claim parked handoffs (the oldest first) while the batch has room: a blocking claim when idle, a
   non-blocking one between steps. A claim moves the prompt's block refs to this session; the blocks are read
   in place, nothing is copied. Handoffs addressed to this worker come to its inbox straight from the prefill;
   their claims are confirmed by the pool before the step, and one it refuses is dropped (its blocks were
   never this worker's).
2. One step for the whole batch (:func:`workers.sequence.decode_step`): one ``alloc`` for every sequence that
   crossed into a new block, then the engine's step (:class:`workers.engine.DecodeEngine`: on CUDA one graph
   replay of the fused forward pass, paged attention reading each block table in place), one greedy token per
   sequence.
3. Finished sequences (``max_new_tokens`` reached): wait for the stream, ``free`` their blocks, print one JSON
   line with the tokens and timings.

If the pool runs out of blocks mid-step, the most recently admitted sequence is preempted, as vLLM does, until
the rest fit: when its handoff carried the prompt's tokens (``HandoffMeta.prompt``) its blocks are freed and it
waits to be recomputed (its prompt's committed blocks are looked up in the pool again, the rest prefilled here);
otherwise it keeps its blocks and waits (it stops growing). Waiting sequences resume, oldest first, before any
new request is claimed. Only when nothing can run at all, and the newest waiting sequence can neither be
recomputed nor freed otherwise, is that one dropped (its blocks freed, an error line printed): a decode worker
must not wait for blocks that only it can free.
A stop signal stops the claiming; sequences already running are finished, then the worker exits.
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from kvpool.devices import DeviceSession
from kvpool.errors import HandoffNotFound, KvpoolError, PoolExhausted
from kvpool.handoffs import Claim
from kvpool.protocol import LookupResponse
from kvpool.workers.cli import (
    add_model_arguments,
    add_pool_arguments,
    connect,
    emit,
    load_model,
    setup,
    synchronize,
)
from kvpool.workers.engine import DecodeEngine
from kvpool.workers.model import KVCaches, LlamaModel
from kvpool.workers.request import HandoffMeta
from kvpool.workers.sequence import Sequence, blocks_needed, decode_step


@dataclass
class Admitted:
    meta: HandoffMeta
    claimed_at: float
    direct: bool
    order: int = 0
    preemptions: int = 0


class DecodeWorker:
    def __init__(
        self,
        pool: DeviceSession,
        model: LlamaModel,
        kv_caches: KVCaches,
        block_size: int,
        max_batch: int,
        stop_at_eos: bool = False,
    ) -> None:
        self.pool = pool
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_batch = max_batch
        self.eos = frozenset(model.config.eos_token_id) if stop_at_eos else frozenset()
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted, oldest admission first
        self.admitted: dict[str, Admitted] = {}
        self.engine = DecodeEngine(model, kv_caches, block_size, max_batch=max_batch)
        self._order = 0

    def admit(self, limit: int, wait_s: float) -> list[dict[str, Any]]:
        """Claim up to ``limit`` handoffs (waiting ``wait_s`` for the first); returns records of any that end
        at once (``max_new_tokens == 1``)."""
        records: list[dict[str, Any]] = []
        if self.waiting:  # preempted sequences come first
            return records
        refused: list[tuple[Claim, str]] = []  # claims this worker cannot decode: freed once they are its own
        for i in range(min(limit, self.max_batch - len(self.running))):
            try:
                claim = self.pool.claim(None, timeout_s=wait_s if i == 0 else 0.0)
            except HandoffNotFound:
                break
            try:
                meta = HandoffMeta.checked(claim.request_id, claim.meta, self.model.config.vocab_size)
                if len(claim.block_ids) < blocks_needed(claim.num_tokens, self.block_size):
                    raise ValueError(f"{len(claim.block_ids)} blocks cannot hold {claim.num_tokens} tokens")
            except ValueError as exc:
                refused.append((claim, str(exc)))
                continue
            seq = Sequence(
                request_id=claim.request_id,
                prompt_len=claim.num_tokens,
                block_ids=list(claim.block_ids),
                output=[meta.first_token],
                max_new_tokens=meta.max_new_tokens,
                eos_token_ids=self.eos,
            )
            self._order += 1
            self.admitted[seq.request_id] = Admitted(meta, time.time(), claim.direct, self._order)
            self.running.append(seq)
        not_ours: set[str] = set()
        try:
            self.pool.confirm()
        except KvpoolError as exc:
            if not exc.refused:
                raise
            not_ours = set(exc.refused)
            records += self._drop(not_ours, str(exc))
        for claim, why in refused:
            if claim.request_id not in not_ours:
                self.pool.free(claim.block_ids)
            records.append({"request_id": claim.request_id, "error": f"refused: {why}", "tokens": []})
        records += self._retire()
        return records

    def _drop(self, request_ids: set[str], why: str) -> list[dict[str, Any]]:
        """Forget sequences whose claims the pool refused, without freeing their blocks: they are not ours."""
        dropped = [s for s in self.running if s.request_id in request_ids]
        self.running = [s for s in self.running if s.request_id not in request_ids]
        return [
            {
                "request_id": s.request_id,
                "error": f"dropped, the pool refused its claim: {why}",
                "tokens": [],
                "prompt_len": self.admitted.pop(s.request_id).meta.prompt_len,
            }
            for s in dropped
        ]

    def step(self) -> list[dict[str, Any]]:
        """One token for every running sequence; records of the sequences that finished (or were dropped)."""
        records: list[dict[str, Any]] = []
        self._resume()
        while self.running:
            try:
                decode_step(self.model, self.kv_caches, self.running, self.pool, self.block_size, self.engine)
                break
            except PoolExhausted:
                self._preempt(self.running.pop())
        if not self.running and any(s.block_ids for s in self.waiting):
            records += self._drop_stuck()
        return records + self._retire()

    def _preempt(self, seq: Sequence) -> None:
        """Stop ``seq`` until blocks free up: free its blocks when it can be recomputed, else let it keep them."""
        info = self.admitted[seq.request_id]
        info.preemptions += 1
        if info.meta.prompt is not None:
            synchronize(self.model.device)  # no kernel of ours still reads the blocks we are about to free
            self.pool.free(seq.block_ids)
            seq.block_ids = []
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: self.admitted[s.request_id].order)

    def _resume(self) -> None:
        """Bring waiting sequences back, oldest first, while the batch has room and the pool has blocks."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not seq.block_ids and not self._recompute(seq):
                break
            self.waiting.pop(0)
            self.running.append(seq)
        self.running.sort(key=lambda s: self.admitted[s.request_id].order)

    def _recompute(self, seq: Sequence) -> bool:
        """Rebuild a preempted sequence's K/V: its prompt's cached blocks from the pool, the rest computed here."""
        prompt = self.admitted[seq.request_id].meta.prompt
        assert prompt is not None
        tokens = [*prompt, *seq.output[:-1]]
        if len(tokens) > self.block_size:  # a full block to find, and at least one token left to compute
            hit = self.pool.lookup(tokens[:-1], salt=self.admitted[seq.request_id].meta.salt)
        else:
            hit = LookupResponse(block_ids=[], num_tokens=0)
        try:
            fresh = self.pool.alloc(blocks_needed(len(tokens), self.block_size) - len(hit.block_ids))
        except PoolExhausted:
            if hit.block_ids:
                self.pool.free(hit.block_ids)
            return False
        seq.block_ids = [*hit.block_ids, *fresh]
        self.model.prefill(tokens, seq.block_ids, hit.num_tokens, self.kv_caches)
        return True

    def _drop_stuck(self) -> list[dict[str, Any]]:
        """Nothing can run and a waiting sequence holds blocks it cannot give up: drop the newest such one."""
        victim = next(s for s in reversed(self.waiting) if s.block_ids)
        self.waiting.remove(victim)
        synchronize(self.model.device)
        self.pool.free(victim.block_ids)
        info = self.admitted.pop(victim.request_id)
        return [
            {
                "request_id": victim.request_id,
                "error": "dropped, the pool is full and the handoff carried no prompt to recompute it from",
                "tokens": victim.output,
                "prompt_len": info.meta.prompt_len,
            }
        ]

    def _retire(self) -> list[dict[str, Any]]:
        done = [s for s in self.running if s.done]
        if not done:
            return []
        self.running = [s for s in self.running if not s.done]
        synchronize(self.model.device)  # no kernel of ours still reads the blocks we are about to free
        self.pool.free([b for s in done for b in s.block_ids])
        now = time.time()
        return [self._record(s, now) for s in done]

    def _record(self, seq: Sequence, now: float) -> dict[str, Any]:
        info = self.admitted.pop(seq.request_id)
        m = info.meta
        decoded = len(seq.output) - 1
        decode_s = now - info.claimed_at
        return {
            "request_id": seq.request_id,
            "prompt_len": m.prompt_len,
            "tokens": seq.output,
            "num_tokens": len(seq.output),
            "hit_tokens": m.hit_tokens,
            "computed_tokens": m.computed_tokens,
            "queue_ms": round(1e3 * (info.claimed_at - m.handed_off_at), 3),
            "direct": info.direct,
            "decode_ms": round(1e3 * decode_s, 3),
            "ms_per_token": round(1e3 * decode_s / decoded, 3) if decoded else None,
            "e2e_ms": round(1e3 * (now - m.arrived_at), 3),
            "preemptions": info.preemptions,
        }

    def close(self) -> None:
        """Give back the blocks of sequences still running (closing the session would also release them)."""
        held = [b for s in self.running + self.waiting for b in s.block_ids]
        if held:
            synchronize(self.model.device)
            self.pool.free(held)
        self.running.clear()
        self.waiting.clear()


def parse_args(argv: Seq[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpool worker decode", description=__doc__.split("\n\n")[0])
    add_pool_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=None, help="exit after this many (default: run on)")
    parser.add_argument("--max-batch", type=int, default=32, help="sequences decoded together per step")
    parser.add_argument("--idle-wait-s", type=float, default=0.5, help="how long one claim waits when idle")
    parser.add_argument("--stop-at-eos", action="store_true", help="end a sequence at the model's EOS token")
    return parser.parse_args(argv)


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(argv)
    setup(args)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    finished = 0
    with connect(args, "decode") as pool:
        layout = pool.descriptor().layout
        blocks = DeviceSession(pool, args.device, layout)
        arena = blocks.arena
        model = load_model(args, layout, arena.device)
        worker = DecodeWorker(blocks, model, arena.kv_caches(), layout.block_size, args.max_batch, args.stop_at_eos)
        worker.engine.capture()  # before the first claim: capturing writes nothing into the arena
        try:
            while args.num_requests is None or finished < args.num_requests:
                busy = len(worker.running) + len(worker.waiting)
                if stopping and not busy:
                    break
                records: list[dict[str, Any]] = []
                if not stopping:
                    left = (args.num_requests - finished - busy) if args.num_requests else 1 << 30
                    wait = 0.0 if busy else args.idle_wait_s
                    records += worker.admit(left, wait)
                if worker.running or worker.waiting:
                    records += worker.step()
                    if not worker.running:
                        time.sleep(0.01)  # every sequence waits for blocks that others must free
                for record in records:
                    emit(record)
                finished += len(records)
        finally:
            worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
