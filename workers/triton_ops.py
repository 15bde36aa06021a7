"""The decode step's small fused kernels for CUDA, in Triton (imported only where a GPU path runs).

At batch 32 a decode step's matmuls read megabytes of weights each, while the elementwise work between them
(RMSNorm, the residual add, RoPE, the K/V store, SiLU times up) touches kilobytes. In eager torch that work is
about twenty kernels a layer, and even inside a CUDA graph each costs a few microseconds of launch and tail, so
here each stretch between two matmuls is one kernel:

* :func:`add_rms_norm`: the residual add and the next RMSNorm;
* :func:`rope_store_kv`: RoPE of q and k from the fused QKV output, and K/V straight into their cache slots
  (a negative slot block skips the store: rows that pad a captured batch write nothing);
* :func:`silu_mul`: ``silu(gate) * up`` from the fused gate-up output.

Rounding follows the eager path: statistics in fp32, every product rounded to the model's dtype where torch
rounds it. RoPE is the exception: the angles and the rotation stay in fp32 and are rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr, res_ptr, w_ptr, out_ptr, hidden, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(res_ptr + row * hidden + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * hidden + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (when given), then RMSNorm of it; ``[N, hidden]``, contiguous."""
    n, hidden = residual.shape
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(n,)](
        residual if delta is None else delta, residual, weight, out, hidden, eps,
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(hidden), num_warps=8 if hidden >= 2048 else 4,
    )  # fmt: skip
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    pos_ptr,
    inv_freq_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    slot_block_ptr,
    slot_off_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. NUM_HEADS + NUM_KV_HEADS - 1: query heads, then KV heads
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(pos_ptr + token).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    row = qkv_ptr + token * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM + head * HEAD_DIM
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if head < NUM_HEADS:
        q_row = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_row + offs, r1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_row + HALF + offs, r2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        block = tl.load(slot_block_ptr + token)
        if block >= 0:
            kv_head = head - NUM_HEADS
            slot = block.to(tl.int64) * stride_kb + tl.load(slot_off_ptr + token) * stride_kt + kv_head * stride_kh
            tl.store(k_ptr + slot + offs, r1.to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(k_ptr + slot + HALF + offs, r2.to(k_ptr.dtype.element_ty), mask=mask)
            v_row = row + NUM_KV_HEADS * HEAD_DIM
            v1 = tl.load(v_row + offs, mask=mask, other=0.0)
            v2 = tl.load(v_row + HALF + offs, mask=mask, other=0.0)
            tl.store(v_ptr + slot + offs, v1.to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptr + slot + HALF + offs, v2.to(v_ptr.dtype.element_ty), mask=mask)


def rope_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotated queries ``[N, num_heads, head_dim]`` from ``qkv`` ``[N, (Hq + 2 Hkv) * D]``; K and V into the cache.

    ``slot_blocks``/``slot_offsets`` ``[N]`` name each token's cache slot; a negative block skips the store.
    """
    n = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or not qkv.is_contiguous():
        raise ValueError("rope_store_kv needs the fused QKV output, contiguous")
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim, not {d}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must share strides")
    q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    _rope_store_kernel[(n, num_heads + num_kv_heads)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_blocks, slot_offsets,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HALF=d // 2,
        BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=1,
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * 2 * width + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[N, 2 I]`` (gate first, as the fused weight stores it); ``[N, I]``."""
    n, two_i = gate_up.shape
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul needs a contiguous input")
    width = two_i // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if n:
        _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, num_warps=4)
    return out
