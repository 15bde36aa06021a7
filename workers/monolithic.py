"""Generation in one process with a private paged cache: the baseline the disaggregated run must equal and beat.

:func:`greedy_generate` is the plain reference (every prompt computed from scratch, then decoded in batches) that
the tests hold the workers' tokens to. :class:`MonolithicEngine` (``python -m kvpool.workers.monolithic``) is the fair
serving baseline: the same model, kernels, batched chunked prefill (:mod:`workers.batching`) and decode step as
the workers, and a prefix cache of its own: the pool's very books (:class:`kvpool.server.books.pool.Pool`), in
process, over a private cache that no other process sees.
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvpool.errors import PoolExhausted
from kvpool.ids import Fences
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.books.records import LookupResult
from kvpool.workers.batching import PrefillBatcher
from kvpool.workers.engine import DecodeEngine
from kvpool.workers.kvcache import private_kv_caches
from kvpool.workers.model import KVCaches, LlamaModel
from kvpool.workers.request import GenerationRequest
from kvpool.workers.sequence import Sequence, blocks_needed, decode_step, greedy


class LocalBlocks:
    """A free list of a private cache's block ids, handed out from the top (so tables are not ``0, 1, 2..``)."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks))

    def alloc(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_ids):
            raise MemoryError(f"private cache exhausted: {num_blocks} blocks asked, {len(self.free_ids)} free")
        taken, self.free_ids = self.free_ids[-num_blocks:][::-1], self.free_ids[:-num_blocks]
        return taken

    def free(self, block_ids: list[int]) -> int:
        self.free_ids.extend(block_ids)
        return len(block_ids)


def greedy_generate(
    model: LlamaModel,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    layout: KVLayout,
    max_batch: int = 32,
    stop_at_eos: bool = False,
) -> list[list[int]]:
    """Generated token ids (``max_new_tokens`` each, fewer if stopped at EOS) for each prompt.

    Prompts are prefilled one by one, then decoded together in batches of up to ``max_batch``, by the same
    :class:`workers.engine.DecodeEngine` (CUDA graphs on a GPU) as the decode worker's.
    """
    bs = layout.block_size
    total = sum(blocks_needed(len(p) + max_new_tokens, bs) for p in prompts)
    caches = private_kv_caches(layout, total, model.device)
    blocks = LocalBlocks(total)
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    engine = DecodeEngine(model, caches, bs, max_batch=max_batch, max_context=longest)
    eos = frozenset(model.config.eos_token_id) if stop_at_eos else frozenset()
    results: list[list[int]] = []
    for start in range(0, len(prompts), max_batch):
        seqs = []
        for i, prompt in enumerate(prompts[start : start + max_batch]):
            table = blocks.alloc(blocks_needed(len(prompt), bs))
            logits = model.prefill(prompt, table, 0, caches)
            seqs.append(Sequence(str(start + i), len(prompt), table, greedy(logits[None])[:1], max_new_tokens, eos))
        active = [s for s in seqs if not s.done]
        while active:
            decode_step(model, caches, active, blocks, bs, engine)
            for s in active:
                if s.done:
                    blocks.free(s.block_ids)
            active = [s for s in active if not s.done]
        results.extend(s.output for s in seqs)
    return results


class PrivateBlocks:
    """A private cache's blocks with a prefix cache: the pool's books in this process, one session, no HTTP.

    Block ids here are indices into the private cache, as :class:`kvpool.devices.DeviceSession` gives them.
    """

    def __init__(self, num_blocks: int, layout: KVLayout, model_name: str = "") -> None:
        self.books = Pool(num_blocks, layout, lease_ttl_s=math.inf, model=model_name)
        self.session = self.books.open_session("monolithic", "other").session_id
        self.fences = Fences(0, num_blocks)

    def alloc(self, num_blocks: int) -> list[int]:
        return self.fences.strip(self.books.alloc(self.session, num_blocks))

    def free(self, block_ids: Seq[int]) -> int:
        return self.books.free(self.session, self.fences.restore(block_ids))

    def lookup(self, token_ids: Seq[int], salt: str | None = None) -> LookupResult:
        hit = self.books.lookup(self.session, token_ids, salt=salt)
        return LookupResult(self.fences.strip(hit.block_ids), hit.num_tokens)

    def commit(self, block_ids: Seq[int], token_ids: Seq[int], salt: str | None = None) -> object:
        return self.books.commit(self.session, self.fences.restore(block_ids), token_ids, salt)

    def stats(self) -> dict[str, Any]:
        return self.books.stats()


class MonolithicEngine:
    """Continuous batching in one process: each iteration admits waiting requests, runs one prefill step (a
    token budget of new prompt tokens) and one decode step for every sequence past its prefill.

    Prefill and decode share the GPU and take turns, which is the interference a disaggregated pair avoids.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCaches,
        blocks: PrivateBlocks,
        block_size: int,
        max_batch: int = 32,
        token_budget: int = 4096,
        prefix_cache: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.block_size = block_size
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.batcher = PrefillBatcher(model, kv_caches, blocks, block_size, token_budget, max_batch, prefix_cache)
        self.engine = DecodeEngine(model, kv_caches, block_size, max_batch=max_batch)
        self.running: list[Sequence] = []
        self.info: dict[str, dict[str, Any]] = {}

    def submit(self, req: GenerationRequest, arrived_at: float | None = None) -> None:
        self.batcher.add(req, arrived_at)

    @property
    def idle(self) -> bool:
        return self.batcher.idle and not self.running

    def iterate(self) -> list[dict[str, Any]]:
        """One round; records: ``{"event": "first"}`` when a request's first token exists, then its final one."""
        records: list[dict[str, Any]] = []
        self.batcher.admit(self.max_batch - len(self.running) - len(self.batcher.running))
        if self.batcher.waiting and not self.batcher.running and not self.running:
            head = self.batcher.waiting.popleft()  # nothing holds a block, yet it does not fit: it never will
            need = blocks_needed(len(head.request.prompt), self.block_size)
            why = f"its prompt needs {need} blocks and the private cache has {self.blocks.books.total_blocks}"
            records.append({"request_id": head.request.request_id, "error": f"too long for this worker: {why}"})
        if self.batcher.running:
            finished = self.batcher.step()
            self.batcher.release(finished)
            for p in finished:
                assert p.first_token is not None
                req = p.request
                if self.prefix_cache:
                    self.blocks.commit(p.block_ids, req.prompt, req.salt)
                seq = Sequence(req.request_id, len(req.prompt), p.block_ids, [p.first_token], req.max_new_tokens)
                self.running.append(seq)
                self.info[req.request_id] = {"hit_tokens": p.hit_tokens, "arrived_at": p.arrived_at}
                records.append({"request_id": req.request_id, "event": "first", "hit_tokens": p.hit_tokens})
        active = [s for s in self.running if not s.done]
        if active:
            try:
                decode_step(self.model, self.kv_caches, active, self.blocks, self.block_size, self.engine)
            except PoolExhausted as exc:
                victim = self.running.pop()
                self.blocks.free(victim.block_ids)
                self.info.pop(victim.request_id)
                why = f"dropped, the private cache is full: {exc}"
                return [*records, {"request_id": victim.request_id, "error": why, "tokens": victim.output}]
        done = [s for s in self.running if s.done]
        if done:
            self.running = [s for s in self.running if not s.done]
            self.blocks.free([b for s in done for b in s.block_ids])
            now = time.time()
            for s in done:
                info = self.info.pop(s.request_id)
                records.append(
                    {
                        "request_id": s.request_id,
                        "prompt_len": s.prompt_len,
                        "tokens": s.output,
                        "hit_tokens": info["hit_tokens"],
                        "e2e_ms": round(1e3 * (now - info["arrived_at"]), 3),
                    }
                )
        return records


def _read(stream: Iterable[str], inbox: queue.Queue[tuple[float, str] | None]) -> None:
    for line in stream:
        if line.strip():
            inbox.put((time.time(), line))
    inbox.put(None)


def main(argv: Seq[str] | None = None) -> int:
    """``python -m kvpool.workers.monolithic``: JSON-lines requests on stdin, JSON lines out (a ``first`` event per
    request, then its tokens), until stdin ends and every request is done."""
    from kvpool.workers.cli import add_model_arguments, emit, load_model, setup
    from kvpool.workers.kvcache import layout_for

    parser = argparse.ArgumentParser(prog="python -m kvpool.workers.monolithic", description=main.__doc__)
    add_model_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-blocks", type=int, required=True, help="blocks of the private cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt from scratch")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    setup(args)
    from kvpool.workers.cli import model_config

    device = torch.device(args.device)
    layout = layout_for(model_config(args), args.block_size, args.kv_dtype)
    model = load_model(args, layout, device)
    blocks = PrivateBlocks(args.num_blocks, layout, "monolithic")
    caches = private_kv_caches(layout, args.num_blocks, device)
    engine = MonolithicEngine(
        model, caches, blocks, layout.block_size, args.max_batch, args.token_budget, not args.no_prefix_cache
    )
    engine.engine.capture()
    emit({"ready": True})
    inbox: queue.Queue[tuple[float, str] | None] = queue.Queue()
    threading.Thread(target=_read, args=(sys.stdin, inbox), name="mono-requests", daemon=True).start()
    ended = False
    while not (ended and engine.idle):
        try:
            item = inbox.get(timeout=0.05) if engine.idle else inbox.get_nowait()
            while not ended:
                if item is None:
                    ended = True
                    break
                engine.submit(GenerationRequest.from_json(item[1]), item[0])
                item = inbox.get_nowait()
        except queue.Empty:
            pass
        for record in engine.iterate():
            emit(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
