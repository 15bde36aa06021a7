"""The KV layout a model needs, and a private cache with the arena's exact geometry.

The monolithic generator and the tests run the same forward pass as the workers, on a cache that is not shared
but is cut from one flat tensor by the same :meth:`KVLayout.view_geometry` as the pool's arena: same shapes,
same strides (``block_major`` views are strided in the block dimension), so a private run exercises the very
indexing the shared one does.
"""

from __future__ import annotations

import torch

from kvpool.errors import LayoutMismatch
from kvpool.layout import KVLayout
from kvpool.workers.model import LlamaConfig


class ModelDoesNotFit(LayoutMismatch, ValueError):
    """The pool's arena was made for another model shape than the worker's model."""


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of a layout's KV; fp8 arenas need scales that the workers do not implement yet."""
    if layout.dtype not in KV_DTYPES:
        raise ModelDoesNotFit(
            f"the workers cannot use a {layout.dtype} arena yet: start the pool with --dtype float32, float16 or "
            "bfloat16"
        )
    return KV_DTYPES[layout.dtype]


def layout_for(config: LlamaConfig, block_size: int, dtype: str, order: str = "layer_major") -> KVLayout:
    """The arena layout that holds this model's KV."""
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=dtype,
        order=order,
    )


def check_layout(config: LlamaConfig, layout: KVLayout) -> None:
    """Refuse an arena whose KV shape is not this model's, naming what differs and the pool flags that fit."""
    want = layout_for(config, layout.block_size, layout.dtype, layout.order)
    diff = want.diff(layout)
    if diff:
        detail = ", ".join(f"{k}: model {a!r} != arena {b!r}" for k, (a, b) in diff.items())
        flags = " ".join(f"--{k.replace('_', '-')} {a}" for k, (a, _) in diff.items())
        raise ModelDoesNotFit(
            f"the arena's KV layout does not fit the model ({detail}): start the pool with {flags}, or give the "
            "worker a model of the pool's shape"
        )
    kv_dtype(layout)


def private_kv_caches(
    layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", fill: float = 0.0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) views ``[num_blocks, block_size, H, D]`` over one fresh tensor laid out like an arena.

    ``fill`` is what unwritten slots hold; tests pass NaN to prove that nothing reads a slot it did not write.
    """
    elems = num_blocks * layout.block_nbytes // layout.itemsize
    flat = torch.full((elems,), fill, dtype=kv_dtype(layout), device=device)
    caches = []
    for layer in range(layout.num_layers):
        (ko, ks, kst), (vo, vs, vst) = (layout.view_geometry(num_blocks, layer, kv) for kv in (0, 1))
        caches.append((flat.as_strided(ks, kst, ko), flat.as_strided(vs, vst, vo)))
    return caches
