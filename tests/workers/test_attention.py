"""Paged attention on the CPU against the fp64 reference: decode fallback, prefill, and the KV writes."""

from __future__ import annotations

import pytest
import torch

from kvpool.layout import KVLayout
from kvpool.workers.attention import (
    DECODE_TOLERANCE,
    gather_context,
    paged_decode_attention,
    prefill_attention,
    reference_attention,
    write_kv,
)
from kvpool.workers.kvcache import private_kv_caches
from tests.workers.helpers import decode_reference, paged_batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("order", ["layer_major", "block_major"])
@pytest.mark.parametrize(
    ("block_size", "lens", "heads"),
    [
        (16, [1, 15, 16, 17, 100], (4, 2, 16)),
        (5, [3, 64, 131], (8, 1, 32)),
        (1, [1, 9], (6, 3, 8)),
        (32, [33, 250], (4, 4, 24)),
    ],
)
def test_decode_fallback_matches_reference(
    dtype: str, order: str, block_size: int, lens: list[int], heads: tuple[int, int, int]
) -> None:
    hq, hkv, d = heads
    q, kc, vc, tables, ctx = paged_batch(
        lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype, order=order
    )
    out = paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5, backend="torch")
    ref = decode_reference(q, kc, vc, tables, ctx, d**-0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "read a slot that was never written"
    assert (out.double() - ref).abs().max().item() <= DECODE_TOLERANCE[q.dtype]


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
@pytest.mark.parametrize(("num_cached", "num_new"), [(0, 1), (0, 23), (16, 1), (32, 9), (48, 40)])
def test_prefill_attention_over_cached_prefix(order: str, num_cached: int, num_new: int) -> None:
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, bs = 6, 2, 16, 8
    layout = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="float32", order=order)
    total = num_cached + num_new
    nb = -(-total // bs)
    kc, vc = private_kv_caches(layout, nb + 4, fill=float("nan"))[0]
    table = torch.randperm(nb + 4, generator=gen)[:nb]
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    pos = torch.arange(total)
    write_kv(kc, vc, k, v, table[pos // bs], pos % bs)
    assert torch.equal(gather_context(kc, table, total), k)
    q = torch.randn(num_new, hq, d, generator=gen)
    out = prefill_attention(q, kc, vc, table, num_cached, d**-0.5)
    ref = reference_attention(q, k, v, d**-0.5, pos[num_cached:])
    assert (out.double() - ref).abs().max().item() <= 1e-5


def test_write_kv_touches_only_its_slots() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", order="block_major")
    caches = private_kv_caches(layout, 6)
    kc, vc = caches[1]
    k = torch.ones(3, 2, 4)
    write_kv(kc, vc, k, 2 * k, torch.tensor([5, 5, 2]), torch.tensor([0, 3, 1]))
    assert kc[5, 0].eq(1).all() and kc[5, 3].eq(1).all() and kc[2, 1].eq(1).all() and vc[2, 1].eq(2).all()
    assert kc.abs().sum() == 3 * 8 and vc.abs().sum() == 2 * 3 * 8
    for layer in (0, 2):  # other layers of the same blocks are untouched
        assert all(t.abs().sum() == 0 for t in caches[layer])
