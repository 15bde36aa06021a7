"""A sequence being decoded, and one batched greedy decode step over many of them.

The decode worker and the monolithic generator both step sequences with :func:`decode_step`, so the two runs
that the demo compares differ only in where blocks come from (the pool, or a private list) and in whether the
prompt's KV was computed in this process.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpool.errors import PoolExhausted
from kvpool.workers.model import KVCaches, LlamaModel


class BlockSource(Protocol):
    """Where blocks come from: :class:`kvpool.client.PoolClient` or :class:`workers.monolithic.LocalBlocks`."""

    def alloc(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: list[int]) -> object: ...


class Stepper(Protocol):
    """A decode step that replays a captured graph: :class:`kvpool.workers.engine.DecodeEngine`."""

    def step(self, seqs: Seq[Sequence]) -> list[int]: ...


@dataclass
class Sequence:
    """A request on the decode side.

    ``num_cached`` tokens have their K/V in ``block_ids``; ``output[-1]`` is the next token to feed, at position
    ``num_cached``. ``output[0]`` is the token sampled from the prompt's last logits (by the prefill).
    """

    request_id: str
    prompt_len: int
    block_ids: list[int]
    output: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def num_cached(self) -> int:
        return self.prompt_len + len(self.output) - 1

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or (
            bool(self.eos_token_ids) and self.output[-1] in self.eos_token_ids
        )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def grow(seqs: Seq[Sequence], blocks: BlockSource, block_size: int, lookahead: int | None = None) -> None:
    """Give every sequence a block for the token it is about to write, with one ``alloc`` for the batch.

    When some sequence needs a block now, every sequence that will need one within ``lookahead`` more tokens
    (default: a block's worth, never past what its ``max_new_tokens`` can write) gets it in the same call: in a
    batch of mixed lengths some sequence crosses a block boundary at almost every step, and a round trip to the
    pool per step would cost more than the step's kernels. If the pool cannot spare the extra blocks, only the
    ones needed now are asked for.
    """
    short = [s for s in seqs if blocks_needed(s.num_cached + 1, block_size) > len(s.block_ids)]
    if not short:
        return
    ahead = block_size if lookahead is None else lookahead
    wants = []
    for s in seqs:
        last = max(s.num_cached + 1, min(s.num_cached + 1 + ahead, s.prompt_len + s.max_new_tokens - 1))
        wants.append(max(0, blocks_needed(last, block_size) - len(s.block_ids)))
    try:
        fresh = blocks.alloc(sum(wants)) if sum(wants) > len(short) else None
    except (PoolExhausted, MemoryError):
        fresh = None
    if fresh is None:
        needy = {id(s) for s in short}
        wants = [1 if id(s) in needy else 0 for s in seqs]
        fresh = blocks.alloc(len(short))
    taken = 0
    for s, n in zip(seqs, wants, strict=True):
        s.block_ids.extend(fresh[taken : taken + n])
        taken += n


def decode_step(
    model: LlamaModel,
    kv_caches: KVCaches,
    seqs: Seq[Sequence],
    blocks: BlockSource,
    block_size: int,
    engine: Stepper | None = None,
) -> None:
    """Feed each sequence's last token, write its K/V, and append the greedy next token (one host sync).

    With an ``engine`` (built over the same model and caches) the step is its graph replay; without, an eager
    forward pass, which is what a caller that steps a batch only once or twice wants.
    """
    grow(seqs, blocks, block_size)
    if engine is not None:
        tokens = engine.step(seqs)
    else:
        logits = model.decode(
            [s.output[-1] for s in seqs], [s.num_cached for s in seqs], [s.block_ids for s in seqs], kv_caches
        )
        tokens = greedy(logits)
    for s, token in zip(seqs, tokens, strict=True):
        s.output.append(token)


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row; ``.tolist()`` is the one point where the host waits for the step's kernels."""
    return logits.argmax(-1).tolist()
