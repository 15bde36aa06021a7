"""Attention over a paged KV cache: prefill, batched decode, and a plain reference for tests.

Every cache tensor here is one layer's K or V as the arena shows it: ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (NHD), possibly strided in dim 0 (``block_major`` arenas interleave layers between blocks). A
sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.

* Prefill runs causal attention of the new tokens over cached plus new keys. Several sequences' new tokens are
  packed into one batch: on CUDA the Triton kernel of :mod:`workers.triton_prefill` reads each sequence's keys in
  place through its block table; elsewhere the torch fallback gathers one sequence's blocks at a time.
* Decode reads K and V in place through the block table: on CUDA with the Triton kernel of
  :mod:`workers.triton_paged`, elsewhere with a torch fallback. The fallback gathers, which is what a CPU can do
  cheaply; the GPU path never copies the context.

Grouped-query attention is done without repeating K and V: the ``G = num_heads // num_kv_heads`` query heads of
one KV head are folded into the query-length dimension, so each KV head is read once for its whole group.

Tolerances that :func:`paged_decode_attention` meets against :func:`reference_attention` (max abs error on
unit-scale random inputs, checked by ``tests/workers``): fp32 ``1e-4``; bf16 ``2e-2``; fp16 ``4e-3``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: max |paged - reference| per KV dtype, for q, k, v drawn from N(0, 1); see tests/workers/test_attention*.py.
DECODE_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 2e-2,
    torch.float16: 4e-3,
}


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """K (or V) of the first ``num_tokens`` positions of one sequence, ``[num_tokens, num_kv_heads, head_dim]``."""
    num_blocks = -(-num_tokens // cache.shape[1])
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:num_tokens]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store each token's K and V (``[N, num_kv_heads, head_dim]``) at its (block, offset) slot, in place."""
    k_cache[slot_blocks, slot_offsets] = k.to(k_cache.dtype)
    v_cache[slot_blocks, slot_offsets] = v.to(v_cache.dtype)


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[T, Hq, D]`` to ``[Hkv, G*T, D]``: the query heads of one KV head become extra query rows."""
    t, hq, d = q.shape
    g = hq // num_kv_heads
    return q.view(t, num_kv_heads, g, d).permute(1, 2, 0, 3).reshape(num_kv_heads, g * t, d)


def _ungrouped(o: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[Hkv, G*T, D]`` to ``[T, Hq, D]``."""
    hkv, gt, d = o.shape
    g = gt // t
    return o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hkv * g, d)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``T`` new tokens at positions ``num_cached ..`` over the sequence's cached blocks.

    The new tokens' K and V must already be written to the cache: reading every key from the cache makes the
    result the same whether a prefix came from the pool or was computed here (the cache dtype rounds both).
    ``q`` is ``[T, num_heads, head_dim]``; returns the same shape in ``q``'s dtype.
    """
    t = q.shape[0]
    total = num_cached + t
    hkv = k_cache.shape[2]
    k = gather_context(k_cache, block_table, total).to(q.dtype).transpose(0, 1)  # [Hkv, S, D]
    v = gather_context(v_cache, block_table, total).to(q.dtype).transpose(0, 1)
    g = q.shape[1] // hkv
    query_pos = torch.arange(num_cached, total, device=q.device)
    key_pos = torch.arange(total, device=q.device)
    mask = (key_pos[None, :] <= query_pos[:, None]).repeat(g, 1)  # [G*T, S], rows ordered as _grouped's
    out = F.scaled_dot_product_attention(_grouped(q, hkv)[None], k[None], v[None], attn_mask=mask, scale=scale)
    return _ungrouped(out[0], t)


def packed_prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    num_cached: list[int],
    scale: float,
) -> torch.Tensor:
    """Packed prefill without Triton: :func:`prefill_attention` per sequence, on its slice of ``q``."""
    out = torch.empty_like(q)
    begin = 0
    for i, (t, cached) in enumerate(zip(q_lens, num_cached, strict=True)):
        part = q[begin : begin + t]
        out[begin : begin + t] = prefill_attention(part, k_cache, v_cache, block_tables[i], cached, scale)
        begin += t
    return out


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention without Triton: gathers the batch's blocks, padded to the longest context.

    ``q`` is ``[B, num_heads, head_dim]``, ``block_tables`` ``[B, max_blocks]`` (unused entries must hold a
    valid block id, such as 0), ``context_lens`` ``[B]``. Scores and softmax run in fp32.
    """
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # [B, nb, bs, Hkv, D] -> [B, Hkv, S, D]
    k = k_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    v = v_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # Slots past a context hold whatever the block held before (NaN, even): weight 0 must not meet them.
    v = v.masked_fill(~valid[:, None, :, None], 0.0)
    out = torch.matmul(scores.softmax(-1), v)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here: a CUDA tensor and an importable ``triton``."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One query token per sequence over its paged context; ``backend`` is ``auto``, ``triton`` or ``torch``.

    Shapes as in :func:`paged_decode_attention_torch`; ``block_tables`` and ``context_lens`` are int32 on the
    cache's device. ``max_context_len``, when the caller knows it, spares the GPU path a device-to-host sync.
    Returns ``[B, num_heads, head_dim]`` in ``q``'s dtype.
    """
    use_triton = backend == "triton" or (backend == "auto" and triton_available(q.device))
    if use_triton:
        from kvpool.workers.triton_paged import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=max_context_len
        )
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def packed_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    num_cached: list[int],
    scale: float,
    device_args: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of several sequences' new tokens, packed in ``q`` ``[sum(q_lens), Hq, D]``.

    Sequence ``i`` has ``num_cached[i]`` tokens in its blocks before its ``q_lens[i]`` new ones, whose K/V must
    already be written. ``device_args`` (``cu_seqlens``, ``num_cached`` as int32 on the device, and the tiles of
    :func:`workers.triton_prefill.prefill_tiles`) are built once per forward by the caller, not once per layer.
    """
    use_triton = backend == "triton" or (backend == "auto" and triton_available(q.device))
    if use_triton:
        from kvpool.workers.triton_prefill import packed_prefill_attention_triton, prefill_tiles

        if device_args is None:
            cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
            cached = torch.tensor(num_cached, dtype=torch.int32, device=q.device)
            device_args = (cu, cached, prefill_tiles(q_lens, q.device))
        cu, cached, tiles = device_args
        return packed_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu, cached, tiles, scale)
    return packed_prefill_attention_torch(q, k_cache, v_cache, block_tables, q_lens, num_cached, scale)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor
) -> torch.Tensor:
    """Textbook attention in fp64 on contiguous K and V, for tests.

    ``q`` ``[T, Hq, D]`` at positions ``q_positions`` ``[T]``; ``k``, ``v`` ``[S, Hkv, D]`` at positions
    ``0 .. S-1``; query ``i`` sees keys at positions ``<= q_positions[i]``. K and V heads are repeated for GQA
    the obvious way, so the folding trick of the real paths is checked too. Returns fp64 ``[T, Hq, D]``.
    """
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("thd,shd->hts", qd, kd) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_positions[:, None].to(q.device)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vd)
