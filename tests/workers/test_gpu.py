"""The Triton paged decode kernel against the fp64 reference, on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from kvpool.workers.attention import DECODE_TOLERANCE

from tests.workers.helpers import decode_reference, paged_batch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("order", ["layer_major", "block_major"])
@pytest.mark.parametrize(
    ("block_size", "lens", "heads"),
    [
        (16, [1, 15, 16, 17, 100, 4097], (32, 8, 128)),
        (7, [3, 64, 131, 1000], (8, 1, 64)),
        (1, [1, 9, 77], (6, 3, 80)),
        (32, [33, 250, 2048], (28, 4, 128)),
        (128, [129, 1, 700], (16, 16, 64)),
    ],
)
@pytest.mark.parametrize("num_splits", [None, 1])
def test_triton_matches_reference(
    dtype: str, order: str, block_size: int, lens: list[int], heads: tuple[int, int, int], num_splits: int | None
) -> None:
    from kvpool.workers.triton_paged import paged_decode_attention_triton

    hq, hkv, d = heads
    q, kc, vc, tables, ctx = paged_batch(
        lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype, order=order,
        device="cuda",
    )  # fmt: skip
    out = paged_decode_attention_triton(q, kc, vc, tables, ctx, d**-0.5, num_splits=num_splits)
    ref = decode_reference(q, kc, vc, tables, ctx, d**-0.5)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= DECODE_TOLERANCE[q.dtype], err


def test_triton_reads_in_place() -> None:
    """No copy of the context: the step's extra memory is the split partials, not the K/V it reads."""
    from kvpool.workers.triton_paged import paged_decode_attention_triton

    lens = [8192] * 4
    q, kc, vc, tables, ctx = paged_batch(
        lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", device="cuda"
    )
    context_bytes = 2 * sum(lens) * 8 * 128 * 2
    paged_decode_attention_triton(q, kc, vc, tables, ctx, 128**-0.5)  # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    paged_decode_attention_triton(q, kc, vc, tables, ctx, 128**-0.5, max_context_len=8192)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < context_bytes / 16
