"""Where a forward pass writes each new token's K/V in the paged cache, and what it attends over: one prefill
sequence, several packed together, or one token for each of a decode batch's sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.workers.attention import (
    triton_available,
)


@dataclass(frozen=True)
class PrefillPiece:
    """New tokens of one sequence for a prefill forward: ``tokens`` go at positions ``start ..``, after the
    ``start`` tokens (a prefix hit, earlier chunks) whose K/V are already in ``block_table``'s blocks."""

    block_table: Sequence[int]
    start: int
    tokens: Sequence[int]


@dataclass
class AttentionBatch:
    """Where the forward pass writes this step's K/V and how it attends.

    ``slot_blocks``/``slot_offsets`` ([N] on the device) name the cache slot of each input token. Prefill
    (``block_table`` of one sequence, ``num_cached`` tokens already in it) and decode (``block_tables``
    [B, max_blocks] int32, ``context_lens`` [B] int32, one token per sequence) fill the other fields; a packed
    prefill (:meth:`packed`) sets ``q_lens`` and ``cached_lens`` per sequence beside ``block_tables``.
    """

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_table: torch.Tensor | None = None
    num_cached: int = 0
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int = 0
    q_lens: list[int] | None = None
    cached_lens: list[int] = field(default_factory=list)
    packed_args: Any = None

    @classmethod
    def prefill(
        cls, block_table: Sequence[int], num_cached: int, num_new: int, block_size: int, device: torch.device
    ) -> AttentionBatch:
        table = torch.tensor(block_table, dtype=torch.long)
        pos = torch.arange(num_cached, num_cached + num_new)
        return cls(
            slot_blocks=table[pos // block_size].to(device),
            slot_offsets=(pos % block_size).to(device),
            block_table=table.to(device),
            num_cached=num_cached,
        )

    @classmethod
    def packed(cls, pieces: Sequence[PrefillPiece], block_size: int, device: torch.device) -> AttentionBatch:
        """Several sequences' new tokens in one batch (``block_tables`` [B, max_blocks], ``q_lens``)."""
        width = max(len(p.block_table) for p in pieces)
        tables = torch.tensor([list(p.block_table) + [0] * (width - len(p.block_table)) for p in pieces])
        rows = torch.cat([torch.full((len(p.tokens),), i) for i, p in enumerate(pieces)])
        pos = torch.cat([torch.arange(p.start, p.start + len(p.tokens)) for p in pieces])
        q_lens, cached = [len(p.tokens) for p in pieces], [p.start for p in pieces]
        batch = cls(
            slot_blocks=tables[rows, pos // block_size].to(device),
            slot_offsets=(pos % block_size).to(device),
            block_tables=tables.to(torch.int32).to(device),
            q_lens=q_lens,
            cached_lens=cached,
        )
        if triton_available(device):
            from kvpool.workers.triton_prefill import prefill_tiles

            cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).to(device)
            batch.packed_args = (cu, torch.tensor(cached, dtype=torch.int32).to(device), prefill_tiles(q_lens, device))
        return batch

    @classmethod
    def decode(
        cls, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int, device: torch.device
    ) -> AttentionBatch:
        """One new token per sequence at ``positions[i]``; its K/V go into that sequence's table too."""
        width = max(len(t) for t in block_tables)
        padded = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.arange(len(positions))
        return cls(
            slot_blocks=padded[rows, pos // block_size].long().to(device),
            slot_offsets=(pos % block_size).to(device),
            block_tables=padded.to(device),
            context_lens=(pos + 1).to(torch.int32).to(device),
            max_context_len=max(positions) + 1,
        )
