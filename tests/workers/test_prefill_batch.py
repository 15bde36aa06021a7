"""Packed prefill: several sequences' new tokens in one forward, over cached prefixes, in chunks.

The attention is checked against the fp64 reference (the torch fallback always, the Triton kernel on CUDA), and
the model's batched, chunked prefill against one request at a time: the same logits, and the same K/V in the
blocks.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.layout import KVLayout
from kvpool.workers.attention import gather_context, packed_prefill_attention, reference_attention, write_kv
from kvpool.workers.kvcache import layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel, PrefillPiece
from kvpool.workers.monolithic import MonolithicEngine, PrivateBlocks, greedy_generate
from kvpool.workers.request import GenerationRequest

SMALL = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
CASES = [(0, 1), (0, 70), (16, 1), (32, 9), (5, 130), (48, 64)]  # (cached, new) per sequence, packed together
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _backends() -> list[str]:
    return ["torch", "triton"] if torch.cuda.is_available() else ["torch"]


def _packed_case(dtype: torch.dtype, order: str, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, bs = 8, 2, 64, 8
    name = str(dtype).removeprefix("torch.")
    layout = KVLayout(num_layers=2, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=name, order=order)
    per_seq = [-(-(c + n) // bs) for c, n in CASES]
    kc, vc = private_kv_caches(layout, sum(per_seq) + 5, device, fill=float("nan"))[1]
    ids = torch.randperm(sum(per_seq) + 5, generator=gen).tolist()
    tables, refs, qs = [], [], []
    for (cached, new), nb in zip(CASES, per_seq, strict=True):
        table, ids = torch.tensor(ids[:nb]), ids[nb:]
        tables.append(table.tolist())
        total = cached + new
        k = torch.randn(total, hkv, d, generator=gen).to(dtype)
        v = torch.randn(total, hkv, d, generator=gen).to(dtype)
        pos = torch.arange(total)
        write_kv(kc, vc, k.to(device), v.to(device), table[pos // bs].to(device), (pos % bs).to(device))
        q = torch.randn(new, hq, d, generator=gen).to(dtype)
        qs.append(q)
        k_read = gather_context(kc, table.to(device), total).cpu()
        v_read = gather_context(vc, table.to(device), total).cpu()
        refs.append(reference_attention(q, k_read, v_read, d**-0.5, pos[cached:]))
    width = max(per_seq)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return torch.cat(qs).to(device), kc, vc, padded, torch.cat(refs)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("order", ["layer_major", "block_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_matches_reference(backend: str, order: str, dtype: torch.dtype) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kc, vc, tables, ref = _packed_case(dtype, order, device)
    out = packed_prefill_attention(
        q, kc, vc, tables, [n for _, n in CASES], [c for c, _ in CASES], 64**-0.5, backend=backend
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "read a slot that was never written"
    assert (out.double().cpu() - ref).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_batched_chunked_prefill_equals_one_at_a_time(device: str) -> None:
    """Three prompts (one over a cached prefix) in one forward, then in chunks: same logits, same K/V (on CUDA
    through the fused kernels and the Triton prefill kernel)."""
    model = LlamaModel.random(SMALL, seed=4, device=device)
    bs = 8
    layout = layout_for(SMALL, bs, "float32", "block_major")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in (37, 5, 60)]
    prompts[2][:24] = prompts[0][:24]  # three full blocks shared with prompt 0
    tables = [[0, 1, 2, 3, 4], [5], [0, 1, 2, 6, 7, 8, 9, 10]]

    solo_caches = private_kv_caches(layout, 11, device, fill=float("nan"))
    solo = [model.prefill(prompts[0], tables[0], 0, solo_caches), model.prefill(prompts[1], tables[1], 0, solo_caches)]
    solo.append(model.prefill(prompts[2], tables[2], 24, solo_caches))

    packed_caches = private_kv_caches(layout, 11, device, fill=float("nan"))
    model.prefill_batch([PrefillPiece(tables[0], 0, prompts[0][:24])], packed_caches)  # the shared prefix first
    first = model.prefill_batch(
        [PrefillPiece(tables[0], 24, prompts[0][24:]), PrefillPiece(tables[1], 0, prompts[1]),
         PrefillPiece(tables[2], 24, prompts[2][24:40])],
        packed_caches,
    )  # fmt: skip
    last = model.prefill_batch([PrefillPiece(tables[2], 40, prompts[2][40:])], packed_caches)  # a second chunk
    for ours, ref in zip([first[0], first[1], last[0]], solo, strict=True):
        assert (ours - ref).abs().max().item() < 1e-4
    assert first[0].argmax() == solo[0].argmax() and last[0].argmax() == solo[2].argmax()
    for layer in range(SMALL.num_hidden_layers):
        for kv in (0, 1):
            torch.testing.assert_close(packed_caches[layer][kv], solo_caches[layer][kv], equal_nan=True)


def test_prefill_batch_refuses_a_table_too_short() -> None:
    model = LlamaModel.random(SMALL, seed=4)
    caches = private_kv_caches(layout_for(SMALL, 8, "float32"), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        model.prefill_batch([PrefillPiece([0], 4, list(range(9)))], caches)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("token_budget", [16, 4096])
def test_monolithic_engine_equals_reference_and_hits_its_cache(token_budget: int, device: str) -> None:
    """Continuous batching with a private prefix cache: the reference's tokens, hits where prompts share blocks,
    and every block back in the books at the end."""
    model = LlamaModel.random(SMALL, seed=6, device=device)
    bs = 8
    layout = layout_for(SMALL, bs, "float32", "block_major")
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, SMALL.vocab_size, (3 * bs,), generator=gen).tolist()
    prompts = [system + torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 2)]
    prompts.append(torch.randint(0, SMALL.vocab_size, (20,), generator=gen).tolist())
    blocks = PrivateBlocks(64, layout)
    caches = private_kv_caches(layout, 64, device)
    engine = MonolithicEngine(model, caches, blocks, bs, max_batch=3, token_budget=token_budget)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(f"r{i}", p, 9))
    records: dict[str, dict[str, object]] = {}
    firsts = set()
    for _ in range(200):
        for r in engine.iterate():
            if r.get("event") == "first":
                firsts.add(r["request_id"])
            else:
                records[str(r["request_id"])] = r
        if engine.idle:
            break
    assert engine.idle and firsts == set(records)
    assert [records[f"r{i}"]["tokens"] for i in range(4)] == greedy_generate(model, prompts, 9, layout)
    assert [records[f"r{i}"]["hit_tokens"] for i in range(4)] == [0, 3 * bs, 3 * bs, 0]
    stats = blocks.stats()
    assert stats["in_use"] == 0 and stats["free"] + stats["cached"] == 64


def test_monolithic_engine_refuses_a_prompt_its_cache_cannot_hold() -> None:
    model = LlamaModel.random(SMALL, seed=6)
    layout = layout_for(SMALL, 8, "float32")
    engine = MonolithicEngine(model, private_kv_caches(layout, 4), PrivateBlocks(4, layout), 8, max_batch=2)
    engine.submit(GenerationRequest("long", list(range(40)), 3))
    engine.submit(GenerationRequest("short", list(range(10)), 3))
    records = [r for _ in range(20) for r in engine.iterate()]
    assert "needs 5 blocks" in str(records[0]["error"]) and records[0]["request_id"] == "long"
    assert records[-1]["request_id"] == "short" and len(records[-1]["tokens"]) == 3
    assert engine.idle and engine.blocks.stats()["in_use"] == 0
