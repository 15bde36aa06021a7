"""Batch invariance: a token's K/V and logits get the same bits whatever else shares its forward.

A GEMM's kernel (tile shape, split-K) is picked from the matrix shapes, so a row's rounding depends on how many
rows came with it. A prompt prefilled alone, packed with others, or after a prefix another request computed gets
K/V that differ in the last bits; in bf16 a near-tie between two logits then flips a greedy token, and a
disaggregated run stops matching a monolithic one for reasons that have nothing to do with the pool.

vLLM's batch-invariant mode swaps in matmul kernels with one fixed tiling. Here the shapes are fixed instead:
every prefill forward is cut into pieces of at most :data:`PREFILL_TOKENS` tokens and padded to exactly that
many, the sampled rows go through the LM head :data:`LOGIT_ROWS` at a time, and the decode engine runs every step
at its ``max_batch`` with one split count (:mod:`workers.engine`). cuBLAS then sees the same shapes on every call,
and each row's result depends on that row alone: the attention kernels already walk each sequence's keys in
absolute tiles that do not depend on the batch. The price is the padding (a 40-token suffix is computed as 256
rows) and one launch sequence per 256 tokens, so the mode is for checking tokens, not for serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvpool.workers.attention_batch import AttentionBatch, PrefillPiece

#: tokens in every prefill forward (padded up to it); a piece longer than this is cut into several forwards
PREFILL_TOKENS = 256
#: rows of every LM-head matmul over sampled hidden states
LOGIT_ROWS = 64


def fixed_groups(pieces: Sequence[PrefillPiece], tokens: int) -> list[list[tuple[int, PrefillPiece]]]:
    """The pieces cut into chunks of at most ``tokens`` and packed, in order, into forwards of at most ``tokens``
    tokens each, every chunk tagged with its piece's index. Two chunks of one piece never share a forward: the
    later one attends over the earlier one's K/V, which must already be in the cache."""
    groups: list[list[tuple[int, PrefillPiece]]] = []
    group: list[tuple[int, PrefillPiece]] = []
    used = 0
    for i, p in enumerate(pieces):
        for off in range(0, len(p.tokens), tokens):
            chunk = PrefillPiece(p.block_table, p.start + off, p.tokens[off : off + tokens])
            if group and (used + len(chunk.tokens) > tokens or group[-1][0] == i):
                groups.append(group)
                group, used = [], 0
            group.append((i, chunk))
            used += len(chunk.tokens)
    if group:
        groups.append(group)
    return groups


def padded(values: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    return torch.cat([values, values.new_full((rows - values.shape[0],), fill)]) if values.shape[0] < rows else values


def invariant_prefill(
    pieces: Sequence[PrefillPiece],
    block_size: int,
    device: torch.device,
    forward: Callable[[torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor],
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``[len(pieces), vocab]`` fp32 logits of each piece's last token, computed in fixed-shape forwards.

    ``forward(ids, positions, batch)`` runs the fused prefill over ``PREFILL_TOKENS`` rows; the padding rows
    have a negative cache slot, so they write nothing, and no attention tile covers them.
    """
    last: list[torch.Tensor | None] = [None] * len(pieces)
    for group in fixed_groups(pieces, PREFILL_TOKENS):
        chunks = [c for _, c in group]
        batch = AttentionBatch.packed(chunks, block_size, device)
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        batch.slot_blocks = padded(batch.slot_blocks, PREFILL_TOKENS, -1)
        batch.slot_offsets = padded(batch.slot_offsets, PREFILL_TOKENS, 0)
        hidden = forward(padded(ids, PREFILL_TOKENS, 0).to(device), padded(positions, PREFILL_TOKENS, 0).to(device),
                         batch)  # fmt: skip
        ends = torch.tensor([len(c.tokens) for c in chunks]).cumsum(0).sub(1)
        for (i, _), row in zip(group, ends.tolist(), strict=True):
            last[i] = hidden[row]  # a later chunk of the same piece overwrites an earlier one's
    rows = torch.stack(last)  # type: ignore[arg-type]
    out = []
    for i in range(0, rows.shape[0], LOGIT_ROWS):
        part = rows[i : i + LOGIT_ROWS]
        full = torch.cat([part, part.new_zeros((LOGIT_ROWS - part.shape[0], part.shape[1]))])
        out.append(logits(full)[: part.shape[0]])
    return torch.cat(out)
