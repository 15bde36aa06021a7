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
@pytest.mark.parametrize(("num_splits", "block_n"), [(None, None), (1, None), (None, 128), (3, 32)])
def test_triton_matches_reference(
    dtype: str,
    order: str,
    block_size: int,
    lens: list[int],
    heads: tuple[int, int, int],
    num_splits: int | None,
    block_n: int | None,
) -> None:
    from kvpool.workers.triton_paged import paged_decode_attention_triton

    hq, hkv, d = heads
    if block_n == 128 and d > 64:
        pytest.skip("128-position tiles are meant for head dims up to 64")
    q, kc, vc, tables, ctx = paged_batch(
        lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype, order=order,
        device="cuda",
    )  # fmt: skip
    out = paged_decode_attention_triton(q, kc, vc, tables, ctx, d**-0.5, num_splits=num_splits, block_n=block_n)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_equals_eager_and_padding_writes_nothing(dtype: torch.dtype) -> None:
    """The fused kernels' step against the eager forward pass, with two padding rows that must not write."""
    from kvpool.workers.kvcache import layout_for, private_kv_caches
    from kvpool.workers.model import AttentionBatch, LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48,
    )  # fmt: skip
    model = LlamaModel.random(config, seed=1, device="cuda", dtype=dtype)
    layout = layout_for(config, 4, str(dtype).removeprefix("torch."), "block_major")
    eager_caches, fused_caches = (private_kv_caches(layout, 30, "cuda", fill=float("nan")) for _ in range(2))
    prompts, tables = [list(range(3, 13)), [5, 6], list(range(20, 41))], [[0, 1, 2], [5], [10, 11, 12, 13, 14, 15]]
    for prompt, table in zip(prompts, tables, strict=True):
        for caches in (eager_caches, fused_caches):
            model.prefill(prompt, table, 0, caches)
    pos = [len(p) for p in prompts]
    batch = AttentionBatch.decode(tables, pos, 4, torch.device("cuda"))
    assert batch.block_tables is not None and batch.context_lens is not None
    ids, positions = torch.tensor([7, 8, 9], device="cuda"), torch.tensor(pos, device="cuda")
    eager = model.logits(model.forward(ids, positions, eager_caches, batch))
    pad = torch.zeros(2, dtype=torch.int32, device="cuda")
    fused = model.logits(
        model.decode_hidden(
            torch.tensor([7, 8, 9, 0, 0], dtype=torch.int32, device="cuda"),
            torch.tensor([*pos, 0, 0], dtype=torch.int32, device="cuda"),
            fused_caches,
            torch.cat([batch.slot_blocks.int(), pad - 1]),
            torch.cat([batch.slot_offsets.int(), pad]),
            torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:2])]),
            torch.cat([batch.context_lens, pad]),
            num_splits=2,
        )
    )[:3]
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (fused - eager).abs().max().item() <= tolerance
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    for (ke, ve), (kf, vf) in zip(eager_caches, fused_caches, strict=True):
        for e, f in ((ke, kf), (ve, vf)):
            assert torch.equal(e.isnan(), f.isnan()), "a padding row wrote, or a slot was missed"
            assert (e.nan_to_num() - f.nan_to_num()).abs().max().item() <= tolerance
