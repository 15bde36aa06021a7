"""The packed prefill-attention kernel for CUDA, in Triton (imported only where a GPU path runs).

A prefill batch is several sequences' new tokens packed end to end (``cu_seqlens``), each sequence with
``num_cached`` tokens already in its blocks (a prefix hit, or earlier chunks of the same prompt). One program
takes ``BLOCK_M`` new tokens of one sequence and one query head, and walks that sequence's keys through its block
table from position 0 up to its last query's position: the cached prefix and the new tokens alike are read
straight from the arena (the new tokens' K/V were written there first), so nothing is gathered and the result
does not depend on whether a prefix came from the pool or was computed here.

Tiles are listed on the host (sequence, first query of the tile), so sequences of any length share one launch
without padding. Block ids are widened to int64 before the stride multiply, as in :mod:`workers.triton_paged`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64


@triton.jit
def _packed_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    cu_ptr,
    cached_ptr,
    tile_seq_ptr,
    tile_m_ptr,
    scale,
    block_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    cached = tl.load(cached_ptr + seq)
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_begin + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    q_pos = cached + offs_m
    end = cached + tl.minimum(q_len, m0 + BLOCK_M)  # the tile's last query sees keys up to end - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + seq * stride_tb
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], fp32
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_begin + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_tiles(q_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query) of every ``BLOCK_M`` tile of the packed batch, as int32 tensors on ``device``."""
    seqs, starts = [], []
    for i, n in enumerate(q_lens):
        for m0 in range(0, n, BLOCK_M):
            seqs.append(i)
            starts.append(m0)
    both = torch.tensor([seqs, starts], dtype=torch.int32).to(device, non_blocking=True)
    return both[0], both[1]


def packed_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_cached: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens ``q`` ``[N, Hq, D]`` over each sequence's paged K/V.

    ``block_tables`` ``[B, max_blocks]``, ``cu_seqlens`` ``[B + 1]`` and ``num_cached`` ``[B]`` are int32 on the
    GPU; ``tiles`` comes from :func:`prefill_tiles`. Returns ``[N, Hq, D]`` in ``q``'s dtype.
    """
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("packed prefill needs head_dim contiguous in q, K and V")
    if k_cache.stride()[1:] != v_cache.stride()[1:] or k_cache.dtype != v_cache.dtype:
        raise ValueError("K and V caches must share dtype and inner strides")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tiles = tiles[0].shape[0]
    if n == 0 or num_tiles == 0:
        return out
    fp32 = k_cache.dtype == torch.float32
    _packed_prefill_kernel[(num_tiles, hq)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens, num_cached, tiles[0], tiles[1],
        scale, k_cache.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=BLOCK_M,
        BLOCK_N=32 if fp32 else 64, PRECISION="ieee" if fp32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
