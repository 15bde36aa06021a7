"""Batch invariance: fixed-shape forwards give a token the same bits whatever shares its batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.workers.attention_batch import PrefillPiece
from kvpool.workers.invariance import fixed_groups
from kvpool.workers.kvcache import layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel

pieces_st = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 90)), min_size=1, max_size=8)


@given(pieces_st, st.integers(1, 64))
def test_groups_cover_every_token_once_in_order_within_the_budget(spec: list[tuple[int, int]], budget: int) -> None:
    pieces = [PrefillPiece([0], start, list(range(n))) for start, n in spec]
    groups = fixed_groups(pieces, budget)
    seen: dict[int, list[int]] = {i: [] for i in range(len(pieces))}
    for group in groups:
        assert sum(len(c.tokens) for _, c in group) <= budget
        owners = [i for i, _ in group]
        assert len(owners) == len(set(owners)), "two chunks of one piece in one forward"
        for i, chunk in group:
            assert chunk.start == pieces[i].start + len(seen[i]), "a chunk must start where the last one ended"
            seen[i].extend(chunk.tokens)
    assert all(seen[i] == list(p.tokens) for i, p in enumerate(pieces))


CONFIG = LlamaConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=2048,
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_logits_do_not_depend_on_packing_or_prefix_reuse(dtype: torch.dtype) -> None:
    """One prompt three ways: alone from scratch, packed with strangers, and after a prefix another forward
    computed (the pool's prefix hit). Invariant forwards give all three the same bits, logits and K/V, including
    across the 256-token cut."""
    bs = 16
    layout = layout_for(CONFIG, bs, str(dtype).removeprefix("torch."), "layer_major")
    model = LlamaModel.random(CONFIG, seed=1, device="cuda", dtype=dtype)
    model.batch_invariant = True
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, CONFIG.vocab_size, (300,), generator=gen).tolist()
    others = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (37, 130)]
    nb = -(-len(prompt) // bs)
    caches = private_kv_caches(layout, 4 * nb + 40, "cuda")

    alone = model.prefill(prompt, list(range(nb)), 0, caches)
    table = list(range(nb, 2 * nb))
    strangers = [list(range(2 * nb + 10 * i, 2 * nb + 10 * i + 10)) for i in range(2)]
    packed = model.prefill_batch(
        [
            PrefillPiece(strangers[0], 0, others[0]),
            PrefillPiece(table, 0, prompt),
            PrefillPiece(strangers[1], 0, others[1]),
        ],
        caches,
    )[1]
    reused = list(range(3 * nb, 4 * nb))
    model.prefill_batch([PrefillPiece(reused, 0, prompt[:208]), PrefillPiece(strangers[0], 0, others[0])], caches)
    after_hit = model.prefill(prompt, reused, 208, caches)

    assert torch.equal(alone, packed) and torch.equal(alone, after_hit)
    for layer in range(CONFIG.num_hidden_layers):
        k = caches[layer][0]
        assert torch.equal(k[:nb], k[nb : 2 * nb]) and torch.equal(k[:nb], k[3 * nb : 4 * nb])
