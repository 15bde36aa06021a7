"""K and V of a vLLM layer's paged cache as NHD views, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

vLLM's attention backends each shape a layer's cache their own way; the arena's per-layer views are NHD. The
copies go through strided views of vLLM's tensor, so whatever its physical order (vLLM's NHD or HND cache
layout), index copies land where the backend's kernels read. Shapes handled, told apart by the model's geometry:

* ``[blocks, heads, block_size, 2 * head_dim]``: K and V packed in the last dim (TRITON_ATTN, FLASH_ATTN and
  FLASHINFER in vLLM 0.26), read as ``cache.transpose(1, 2).split(head_dim, -1)``;
* ``[blocks, 2 * heads, block_size, head_dim]``: K heads then V heads (FLASHINFER's split-heads variant);
* ``[2, blocks, block_size, heads, head_dim]`` and ``[blocks, 2, block_size, heads, head_dim]`` (older vLLMs).
"""

from __future__ import annotations

import torch

from kvpool.errors import LayoutMismatch
from kvpool.layout import KVLayout


def kv_views(cache: torch.Tensor, layout: KVLayout, name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` NHD views of one layer's cache; a shape this connector cannot read refuses the engine."""
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    s = tuple(cache.shape)
    if cache.dim() == 4 and s[1:] == (h, bs, 2 * d):
        k, v = cache.transpose(1, 2).split(d, dim=-1)
    elif cache.dim() == 4 and s[1:] == (2 * h, bs, d):
        k, v = (x.transpose(1, 2) for x in cache.split(h, dim=1))
    elif cache.dim() == 5 and s[0] == 2 and s[2:] == (bs, h, d):
        k, v = cache[0], cache[1]
    elif cache.dim() == 5 and s[1] == 2 and s[2:] == (bs, h, d):
        k, v = cache[:, 0], cache[:, 1]
    else:
        raise LayoutMismatch(
            f"vLLM's KV cache of {name} is shaped {list(s)}, which kvpool cannot read for {h} KV heads x head dim "
            f"{d} x block size {bs}: start vLLM with --attention-backend TRITON_ATTN"
        )
    if cache.dtype != _torch_dtype(layout.dtype):
        raise LayoutMismatch(
            f"vLLM's KV cache of {name} is {cache.dtype}, the kvpool arena {layout.dtype}: start the pool with "
            f"`kvpool serve --dtype {str(cache.dtype).removeprefix('torch.')}` (or vLLM with a matching --dtype)"
        )
    return k, v


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class BlockCopier:
    """Batched block copies between vLLM's per-layer views and the arena's: one gather and one scatter per layer
    and K/V for a whole step's blocks, never one launch per block."""

    def __init__(self, engine: list[tuple[torch.Tensor, torch.Tensor]], arena: list[tuple[torch.Tensor, torch.Tensor]]):
        if len(engine) != len(arena):
            raise LayoutMismatch(f"vLLM has {len(engine)} attention layers, the arena {len(arena)}")
        self.engine, self.arena = engine, arena
        self.device = engine[0][0].device

    def _index(self, ids: list[int]) -> torch.Tensor:
        """On the device, through pinned memory: a copy from pageable memory can wait for the stream's queued work,
        after a forward for as long as the forward runs (saves held the engine's thread up to 60 ms on an H100)."""
        host = torch.tensor(ids, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def load(self, arena_ids: list[int], engine_ids: list[int]) -> None:
        """arena blocks ``arena_ids[i]`` -> vLLM blocks ``engine_ids[i]``, on the current stream."""
        self._copy(self.arena, arena_ids, self.engine, engine_ids)

    def save(self, engine_ids: list[int], arena_ids: list[int]) -> None:
        """vLLM blocks ``engine_ids[i]`` -> arena blocks ``arena_ids[i]``, on the current stream."""
        self._copy(self.engine, engine_ids, self.arena, arena_ids)

    def _copy(self, src: list, src_ids: list[int], dst: list, dst_ids: list[int]) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        if not src_ids:
            return
        s, d = self._index(src_ids), self._index(dst_ids)
        for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
            dk.index_copy_(0, d, sk.index_select(0, s))
            dv.index_copy_(0, d, sv.index_select(0, s))

    def index(self, ids: list[int]) -> torch.Tensor:
        return self._index(ids)

    def load_layer(self, layer: int, arena_index: torch.Tensor, engine_index: torch.Tensor) -> None:
        """One layer's share of :meth:`load`, with indices from :meth:`index`, on the current stream."""
        (sk, sv), (dk, dv) = self.arena[layer], self.engine[layer]
        dk.index_copy_(0, engine_index, sk.index_select(0, arena_index))
        dv.index_copy_(0, engine_index, sv.index_select(0, arena_index))
