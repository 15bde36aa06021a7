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

import logging

import torch

from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm import blockcopy
from kvpool.layout import KVLayout

log = logging.getLogger("vllm.kvpool")


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
    """Batched block copies between vLLM's per-layer views and the arena's, never one launch per block: a step's
    blocks of every layer, K and V, in one Triton launch (:mod:`.blockcopy`) where the views allow, else one
    gather and one scatter per layer and K/V."""

    def __init__(self, engine: list[tuple[torch.Tensor, torch.Tensor]], arena: list[tuple[torch.Tensor, torch.Tensor]],
                 kernel: bool | None = None):  # fmt: skip
        if len(engine) != len(arena):
            raise LayoutMismatch(f"vLLM has {len(engine)} attention layers, the arena {len(arena)}")
        self.engine, self.arena = engine, arena
        self.device = engine[0][0].device
        self.sides: tuple[blockcopy.Side, blockcopy.Side] | None = None
        self.shape = tuple(engine[0][0].shape[1:])
        if blockcopy.usable(self.device) if kernel is None else kernel:
            e, a = blockcopy.side(engine), blockcopy.side(arena)
            if e is not None and a is not None and tuple(arena[0][0].shape[1:]) == self.shape:
                self.sides = (e, a)
                if self.device.type == "cuda":
                    self._warmup()

    def _warmup(self) -> None:
        assert self.sides is not None
        e, a = self.sides
        pairs = torch.zeros(2, 1, dtype=torch.long, device=self.device)
        try:
            blockcopy.warmup(a, e, pairs, len(self.engine), self.shape)
            blockcopy.warmup(e, a, pairs, len(self.engine), self.shape)
        except Exception as exc:  # the first step compiles instead
            log.warning("kvpool: compiling the block copy ahead failed (%s)", exc)

    def pairs(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """``[2, n]`` on the device, in one copy through pinned memory: a copy from pageable memory can wait for the
        stream's queued work, after a forward for as long as the forward runs (saves held the engine's thread up to
        60 ms on an H100)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        host = torch.tensor([src_ids, dst_ids], dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def load(self, arena_ids: list[int], engine_ids: list[int]) -> None:
        """arena blocks ``arena_ids[i]`` -> vLLM blocks ``engine_ids[i]``, on the current stream."""
        if arena_ids or engine_ids:
            self._copy(False, self.pairs(arena_ids, engine_ids), 0, len(self.engine))

    def save(self, engine_ids: list[int], arena_ids: list[int]) -> None:
        """vLLM blocks ``engine_ids[i]`` -> arena blocks ``arena_ids[i]``, on the current stream."""
        if arena_ids or engine_ids:
            self._copy(True, self.pairs(engine_ids, arena_ids), 0, len(self.engine))

    def load_layer(self, layer: int, pairs: torch.Tensor) -> None:
        """One layer's share of :meth:`load`, with ``pairs(arena_ids, engine_ids)``, on the current stream."""
        self._copy(False, pairs, layer, 1)

    def _copy(self, save: bool, pairs: torch.Tensor, layer0: int, layers: int) -> None:
        if self.sides is not None:
            e, a = self.sides
            src, dst = (e, a) if save else (a, e)
            blockcopy.copy(src, dst, pairs, layer0, layers, self.shape)  # type: ignore[arg-type]
            return
        src, dst = (self.engine, self.arena) if save else (self.arena, self.engine)
        s, d = pairs[0], pairs[1]
        for (sk, sv), (dk, dv) in zip(src[layer0 : layer0 + layers], dst[layer0 : layer0 + layers], strict=True):
            dk.index_copy_(0, d, sk.index_select(0, s))
            dv.index_copy_(0, d, sv.index_select(0, s))
