"""A step's block copies for every layer, K and V, in one Triton launch.

The torch path launches an index_select and an index_copy_ per layer and K/V (64 launches and 32 temporaries for
16 layers), which held the engine's thread ~1.5 ms per load and ~2 ms per save on an H100. Here one program copies
one block of one layer's K or V. Each side's views never move once registered, so a side is its lowest-addressed
view (the base the kernel gets) plus an int64 table of every view's offset from it, in elements, built once.
Strides are passed as they are, so the strided views of :func:`.kvviews.kv_views` are copied in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch loop copies
    triton = None


@dataclass(frozen=True)
class Side:
    """One side's views as the kernel reads them: ``offsets[2 * layer + kv]`` elements from ``base``."""

    base: torch.Tensor
    offsets: torch.Tensor
    strides: tuple[int, int, int, int]


def side(views: list[tuple[torch.Tensor, torch.Tensor]]) -> Side | None:
    """``None`` where one launch cannot address every view (shapes or strides that differ between views)."""
    flat = [t for kv in views for t in kv]
    first = flat[0]
    if any(t.shape[1:] != first.shape[1:] or t.stride() != first.stride() or t.dtype != first.dtype for t in flat):
        return None
    size = first.element_size()
    base = min(flat, key=lambda t: t.data_ptr())
    delta = [t.data_ptr() - base.data_ptr() for t in flat]
    if any(x % size for x in delta):
        return None
    offsets = torch.tensor([x // size for x in delta], dtype=torch.int64, device=first.device)
    s = first.stride()
    return Side(base, offsets, (s[0], s[1], s[2], s[3]))


def usable(device: torch.device) -> bool:
    """Triton present and a device it compiles for (or its interpreter, ``TRITON_INTERPRET=1``, on the CPU)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def copy(src: Side, dst: Side, pairs: torch.Tensor, layer0: int, layers: int, shape: tuple[int, int, int]) -> None:
    """``pairs[0, i]`` of ``src`` -> ``pairs[1, i]`` of ``dst``, K and V of layers ``layer0 .. layer0+layers-1``,
    on the current stream; ``shape`` is one block's ``(block_size, heads, head_dim)``."""
    n = pairs.shape[1]
    if n == 0:
        return
    _launch(src, dst, pairs, n, layer0, layers, shape)


def _launch(src: Side, dst: Side, pairs: torch.Tensor, n: int, layer0: int, layers: int,
            shape: tuple[int, int, int], warm: bool = False) -> None:  # fmt: skip
    bs, h, d = shape
    dp = triton.next_power_of_2(d)
    rows = max(1, min(triton.next_power_of_2(bs * h), 2048 // dp))
    args = (src.base, src.offsets, dst.base, dst.offsets, pairs, n, layer0, *src.strides, *dst.strides)
    meta = {"H": h, "D": d, "R": bs * h, "DP": dp, "ROWS": rows}
    if warm:
        _copy_blocks.warmup(*args, **meta, grid=(1,))
    else:
        _copy_blocks[(n, 2 * layers)](*args, **meta)


def warmup(src: Side, dst: Side, pairs: torch.Tensor, layers: int, shape: tuple[int, int, int]) -> None:
    """Compile before the first step does (a compile takes the engine's thread for a second or more)."""
    _launch(src, dst, pairs, pairs.shape[1], 0, layers, shape, warm=True)


if triton is not None:

    @triton.jit
    def _copy_blocks(src_base, src_off, dst_base, dst_off, pairs, n, layer0,
                     s_blk, s0, s1, s2, d_blk, d0, d1, d2,
                     H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, DP: tl.constexpr,
                     ROWS: tl.constexpr):  # fmt: skip
        p = tl.program_id(0)
        t = layer0 * 2 + tl.program_id(1)
        sb = tl.load(pairs + p)
        db = tl.load(pairs + n + p)
        src = src_base + tl.load(src_off + t) + sb * s_blk
        dst = dst_base + tl.load(dst_off + t) + db * d_blk
        cols = tl.arange(0, DP)
        cmask = cols < D
        for r0 in range(0, R, ROWS):
            r = r0 + tl.arange(0, ROWS)
            m = (r < R)[:, None] & cmask[None, :]
            i0, i1 = r // H, r % H
            x = tl.load(src + (i0 * s0 + i1 * s1)[:, None] + cols[None, :] * s2, mask=m)
            tl.store(dst + (i0 * d0 + i1 * d1)[:, None] + cols[None, :] * d2, x, mask=m)
