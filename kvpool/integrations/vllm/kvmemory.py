"""Where a resident engine's KV cache lives: each layer's cache tensor is that layer's region of the mapped arena.

vLLM 0.26 builds the worker-side connector before it allocates the KV cache (``Worker.initialize_from_config``),
and allocates it in one replaceable function per model runner: ``GPUModelRunner._allocate_kv_cache_tensors`` (V1)
and ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache`` (V2, the default for dense models). Both return, per
layer, a flat int8 tensor of ``num_blocks * page_bytes`` that vLLM then views as its attention backend's shape;
:func:`install` makes them return the arena's bytes instead, when (and only when) the engine asks for exactly the
arena's geometry, so vLLM's profiling pass, which asks for a few blocks, keeps its own scratch. Everything after
(reshape, binding, CUDA graph capture) runs unchanged on arena addresses; the arena stays mapped while the process
lives, so no captured address ever moves.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvpool.errors import LayoutMismatch
from kvpool.layout import KVLayout

log = logging.getLogger("vllm.kvpool")

_WRAPPED = "_kvpool_arena"


class ArenaKV:
    """The arena's layer regions as vLLM's raw KV tensors, and the check of what vLLM made of them."""

    def __init__(self, raw: torch.Tensor, layout: KVLayout, num_blocks: int) -> None:
        if layout.order != "kv_packed":
            raise LayoutMismatch(
                f"resident mode needs a kv_packed arena, not {layout.order}: kvpool serve --order kv_packed"
            )
        self.raw = raw
        self.layout = layout
        self.num_blocks = num_blocks
        self.layer_bytes = layout.layer_region(num_blocks, 0)[1]
        self.page_bytes = self.layer_bytes // num_blocks
        self.handed: dict[str, int] = {}  # layer name -> layer index, for what this process gave vLLM

    def layer(self, index: int) -> torch.Tensor:
        offset, size = self.layout.layer_region(self.num_blocks, index)
        return self.raw[offset : offset + size]

    def allocate(self, kv_cache_config: Any, layer_index: Callable[[str], int]) -> dict[str, torch.Tensor] | None:
        """The raw tensors vLLM asked for, from the arena; None where the request is not the arena's geometry (a
        profiling pass's few blocks), so vLLM allocates its own as usual."""
        if kv_cache_config.num_blocks != self.num_blocks:
            return None
        out: dict[str, torch.Tensor] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            if getattr(tensor, "block_stride", 0) or len(tensor.shared_by) != 1:
                raise LayoutMismatch(
                    "resident mode gives each attention layer a KV cache of its own; this engine packs or shares "
                    "layers' caches (cross-layer blocks, KV sharing): use the kvpool connector's copy mode"
                )
            if tensor.size != self.layer_bytes:
                raise LayoutMismatch(
                    f"vLLM asks for {tensor.size} bytes of KV per layer, the arena holds {self.layer_bytes} "
                    f"({self.num_blocks} blocks of {self.page_bytes} bytes): start the pool with this engine's "
                    "--num-layers, --num-kv-heads, --head-dim, --block-size and --dtype"
                )
            (name,) = tensor.shared_by
            index = layer_index(name)
            out[name] = self.layer(index)
            self.handed[name] = index
        if len(set(self.handed.values())) != len(self.handed):
            raise LayoutMismatch("two attention layers of this engine map to one arena layer: use copy mode")
        log.info("kvpool: the engine's KV cache is the arena (%d layers x %d blocks)", len(out), self.num_blocks)
        return out

    def check(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """What vLLM bound as each layer's cache must be that layer's region, laid out as the arena lays it out
        (each block's tokens, each token's heads with K then V): else its KV is not where other engines look."""
        if not self.handed:
            raise LayoutMismatch(
                "vLLM allocated its KV cache without the arena: this vLLM's model runner was not patched (a model "
                "runner kvpool does not know, or the cross-layer layout): use the kvpool connector's copy mode"
            )
        lay = self.layout
        for name, cache in kv_caches.items():
            index = self.handed.get(name)
            if index is None:
                raise LayoutMismatch(f"vLLM bound a KV cache for {name} that kvpool did not give it")
            start = self.layer(index).data_ptr()
            # a backend that splits a block into kernel blocks (vLLM 0.29+) views the same bytes, r rows a block
            split = max(1, cache.shape[0] // self.num_blocks) if cache.dim() == 4 else 1
            tokens = lay.block_size // split
            shape = (self.num_blocks * split, lay.num_kv_heads, tokens, 2 * lay.head_dim)
            want = (
                tokens * lay.num_kv_heads * 2 * lay.head_dim,
                2 * lay.head_dim,
                lay.num_kv_heads * 2 * lay.head_dim,
                1,
            )
            if cache.data_ptr() != start or tuple(cache.shape) != shape or tuple(cache.stride()) != want:
                raise LayoutMismatch(
                    f"vLLM's KV cache of {name} is not the arena's layer {index} as kv_packed lays it out (shape "
                    f"{tuple(cache.shape)}, strides {tuple(cache.stride())}, at {cache.data_ptr():#x} vs {start:#x}): "
                    "use an attention backend with vLLM's NHD layout (TRITON_ATTN, FLASH_ATTN) and no "
                    "VLLM_KV_CACHE_LAYOUT=HND, or the connector's copy mode"
                )


def allocation_points() -> list[str]:
    """The model runners of this vLLM whose KV cache allocation :func:`install` can point at the arena."""
    found = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if hasattr(GPUModelRunner, "_allocate_kv_cache_tensors"):
            found.append("v1")
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu import attn_utils

        if hasattr(attn_utils, "_allocate_kv_cache"):
            found.append("v2")
    except ImportError:
        pass
    return found


def install(arena: ArenaKV, layer_index: Callable[[str], int]) -> list[str]:
    """Make both model runners of this vLLM take their KV cache from ``arena``; returns the runners patched."""
    patched = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original_v1 = GPUModelRunner._allocate_kv_cache_tensors
        if getattr(original_v1, _WRAPPED, None) is not None:
            original_v1 = getattr(original_v1, _WRAPPED)

        @functools.wraps(original_v1)
        def allocate_v1(runner: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
            got = arena.allocate(kv_cache_config, layer_index)
            return got if got is not None else original_v1(runner, kv_cache_config)

        setattr(allocate_v1, _WRAPPED, original_v1)
        GPUModelRunner._allocate_kv_cache_tensors = allocate_v1  # type: ignore[method-assign]
        patched.append("v1")
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu import attn_utils

        original_v2 = attn_utils._allocate_kv_cache
        if getattr(original_v2, _WRAPPED, None) is not None:
            original_v2 = getattr(original_v2, _WRAPPED)

        @functools.wraps(original_v2)
        def allocate_v2(kv_cache_config: Any, shared_layers: dict[str, str], device: torch.device) -> Any:
            got = arena.allocate(kv_cache_config, layer_index)
            if got is not None and shared_layers:
                raise LayoutMismatch("resident mode cannot serve KV sharing between layers: use copy mode")
            return got if got is not None else original_v2(kv_cache_config, shared_layers, device)

        setattr(allocate_v2, _WRAPPED, original_v2)
        attn_utils._allocate_kv_cache = allocate_v2
        patched.append("v2")
    except ImportError:
        pass
    return patched
