"""Greedy generation in one process with a private paged cache: the baseline the disaggregated run must equal.

Same model, same kernels, same decode step as the workers; only the blocks are private (a free list over a
cache from :func:`workers.kvcache.private_kv_caches`) and every prompt is computed from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvpool.layout import KVLayout
from workers.engine import DecodeEngine
from workers.kvcache import private_kv_caches
from workers.model import LlamaModel
from workers.sequence import Sequence, blocks_needed, decode_step, greedy


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
