"""The paged decode-attention kernel for CUDA, in Triton (imported only where a GPU path runs).

One program handles one sequence, one KV head and one slice of the context. It keeps the KV head's whole query
group (``G`` query heads) as the rows of one ``tl.dot``, walks the slice ``BLOCK_N`` positions at a time, looks
each position's block up in the block table, and loads K and V straight from the arena with the arena's own
strides: nothing is gathered or copied, and ``block_major`` arenas (strided in the block dimension) work as
they are. Positions are addressed one by one (block ``p // block_size``, offset ``p % block_size``), so any
block size works, powers of two or not.

Long contexts with few sequences would leave most of the GPU idle, so the context is split across programs
(flash-decoding): each slice writes a partial output and its log-sum-exp, and a second small kernel merges them.
The split count is picked from the batch, the KV heads and the number of multiprocessors.

Block ids are widened to int64 before they are multiplied by the block stride: an arena of more than 2^31
elements (4 GiB of fp16) is normal.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    block_size,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    # each sequence cuts its own context into num_splits tile-aligned slices: nothing depends on the batch's
    # longest context, so one launch (or one captured graph) serves every mix of lengths
    per_split = ((ctx + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(ctx, start + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q.to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    table = tables_ptr + seq * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N], fp32
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [B, Hq, num_splits, HEAD_DIM] fp32 and [B, Hq, num_splits] fp32, contiguous
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    row = (seq * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context (a padding row): every weight 0, output 0
    weight = tl.exp(lse - top)
    total = tl.sum(weight, 0)
    weight = weight / tl.where(total > 0, total, 1.0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: programs per multiprocessor that :func:`choose_splits` aims the grid at
WAVES = 2
#: context positions per tile; None: 64 for head dims up to 128, else 32 (``kvpool bench decode --block-n`` sets it)
BLOCK_N: int | None = None


def default_block_n(head_dim: int) -> int:
    return BLOCK_N or (64 if head_dim <= 128 else 32)


def choose_splits(
    batch: int, num_kv_heads: int, max_context_len: int, block_n: int, device: torch.device, waves: int = WAVES
) -> int:
    """Split the context until the grid fills about ``waves`` waves of the GPU, keeping >= 4 tiles per split."""
    programs = batch * num_kv_heads
    want = -(-waves * _num_sms(device.index or 0) // programs)
    most = max(1, max_context_len // (4 * block_n))
    return int(max(1, min(want, most, 64)))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, Hq, D]`` over paged K/V ``[num_blocks, block_size, Hkv, D]``.

    ``block_tables`` ``[B, max_blocks]`` and ``context_lens`` ``[B]`` are int32 on the GPU; a sequence of length
    0 (a row that pads a captured batch) reads nothing and gets zeros. The split count is the only thing the
    launch takes from the contexts' lengths: pass ``num_splits`` (a CUDA graph must, its launch is fixed) or
    ``max_context_len``, else it costs a device-to-host sync. ``block_n``, ``num_warps`` and ``num_stages``
    are tuning knobs for benchmarks.
    """
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged decode needs head_dim contiguous in q, K and V")
    if k_cache.stride()[1:] != v_cache.stride()[1:] or k_cache.dtype != v_cache.dtype:
        raise ValueError("K and V caches must share dtype and inner strides")
    group = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_n = block_n or default_block_n(d)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_splits(b, hkv, max_context_len, block_n, q.device)
    splits = num_splits
    if splits > 1:
        part_out = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when it does not split
    block_d = max(16, triton.next_power_of_2(d))
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale, block_size, splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, SPLIT=splits > 1, PRECISION=precision,
        num_warps=num_warps, **extra,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(b, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), hq, splits,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )  # fmt: skip
    return out
