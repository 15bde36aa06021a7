"""What the GPU tests of copies between arenas share: random KV written into an arena's blocks, and read back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.arena import Arena


def fill(arena: Arena, block_ids: Sequence[int]) -> torch.Tensor:
    """Random KV in every layer's K and V of ``block_ids``, written and synchronized; returned on the CPU."""
    view, dim = arena.blocks_view()
    idx = torch.tensor(arena.local_ids(block_ids), device=view.device)
    payload = torch.randn(view.index_select(dim, idx).shape, device=view.device).to(view.dtype)
    view.index_copy_(dim, idx, payload)
    torch.cuda.synchronize(view.device)
    return payload.cpu()


def read(arena: Arena, block_ids: Sequence[int]) -> torch.Tensor:
    """Every layer's K and V of ``block_ids``, on the CPU."""
    view, dim = arena.blocks_view()
    return view.index_select(dim, torch.tensor(arena.local_ids(block_ids), device=view.device)).cpu()
