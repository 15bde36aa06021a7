"""The decode engine: a batch whose members join, leave and change order between steps decodes each sequence
exactly as it would decode alone; on CUDA that is the captured graphs (with padding rows), on the CPU the same
bookkeeping feeding the eager pass."""

from __future__ import annotations

import random

import pytest
import torch

from kvpool.workers.engine import DecodeEngine
from kvpool.workers.kvcache import layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel
from kvpool.workers.monolithic import LocalBlocks, greedy_generate
from kvpool.workers.sequence import Sequence, blocks_needed, decode_step, greedy

CONFIG = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_churning_batch_decodes_each_sequence_as_alone(device: str) -> None:
    model = LlamaModel.random(CONFIG, seed=4, device=device)
    layout = layout_for(CONFIG, 4, "float32", "block_major")
    rng = random.Random(0)
    prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    new_tokens = [rng.randint(1, 14) for _ in prompts]
    alone = [greedy_generate(model, [p], n, layout, max_batch=1)[0] for p, n in zip(prompts, new_tokens, strict=True)]

    caches = private_kv_caches(layout, 200, device, fill=float("nan"))
    blocks = LocalBlocks(200)
    # max_context 8 is far too short: the tables must widen (and graphs be captured again) on the way
    engine = DecodeEngine(model, caches, 4, max_batch=5, max_context=8)
    waiting = list(zip(prompts, new_tokens, strict=True))
    running: list[Sequence] = []
    finished: dict[str, list[int]] = {}
    while waiting or running:
        while waiting and len(running) < 5 and rng.random() < 0.6:
            prompt, n = waiting.pop(0)
            table = blocks.alloc(blocks_needed(len(prompt), 4))
            first = greedy(model.prefill(prompt, table, 0, caches)[None])[0]
            running.append(Sequence(str(len(prompts) - len(waiting) - 1), len(prompt), table, [first], n))
        rng.shuffle(running)  # rows change owners between steps
        active = [s for s in running if not s.done]
        if active:
            decode_step(model, caches, active, blocks, 4, engine)
        for s in [s for s in running if s.done]:
            finished[s.request_id] = s.output
            blocks.free(s.block_ids)
        running = [s for s in running if not s.done]
    assert [finished[str(i)] for i in range(len(prompts))] == alone
    assert engine.width > 2
    if device == "cuda":
        assert engine.graphs, "the CUDA engine ran eagerly"
    assert sorted(blocks.free_ids) == list(range(200))


def test_engine_refuses_what_it_cannot_run() -> None:
    model = LlamaModel.random(CONFIG, seed=4)
    caches = private_kv_caches(layout_for(CONFIG, 4, "float32"), 20)
    engine = DecodeEngine(model, caches, 4, max_batch=2)
    seqs = [Sequence(str(i), 3, [i], [1], 5) for i in range(3)]
    with pytest.raises(ValueError, match="max_batch of 2"):
        engine.step(seqs)
    with pytest.raises(ValueError, match="no block for position 5"):
        engine.step([Sequence("x", 4, [0], [1, 2], 5)])
    with pytest.raises(ValueError, match="max_batch"):
        DecodeEngine(model, caches, 4, max_batch=0)
    assert torch.isfinite(caches[0][0]).all()


class CountingBlocks(LocalBlocks):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.calls = 0

    def alloc(self, num_blocks: int) -> list[int]:
        self.calls += 1
        return super().alloc(num_blocks)


@pytest.mark.slow
def test_growth_asks_the_pool_about_once_a_block() -> None:
    """Mixed lengths cross block boundaries at almost every step; the pool is asked once per block_size + 1."""
    model = LlamaModel.random(CONFIG, seed=4)
    caches = private_kv_caches(layout_for(CONFIG, 4, "float32"), 200)
    blocks = CountingBlocks(200)
    seqs = [Sequence(str(n), n, blocks.alloc(blocks_needed(n, 4)), [1], 40) for n in (5, 6, 7, 8, 9, 10)]
    blocks.calls = 0
    engine = DecodeEngine(model, caches, 4, max_batch=6)
    for _ in range(30):
        decode_step(model, caches, seqs, blocks, 4, engine)
    assert blocks.calls <= 30 // 5 + 1
    for s in seqs:  # every written position has its block, and at most a block's worth more is held
        assert blocks_needed(s.num_cached, 4) <= len(s.block_ids) <= blocks_needed(s.num_cached + 4, 4)
