"""The same tokens whether a prompt's prefix was computed, found in the arena, or restored from the host tier.

Real ``kvpool serve`` (with ``--host-blocks``) and worker processes over the tiny random model, on the GPU when
there is one (the tier is then page-locked host memory, copied on a side stream), else in shared memory.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.client import http_client
from kvpool.workers import demo
from kvpool.workers.cli import TINY
from kvpool.workers.kvcache import layout_for
from kvpool.workers.model import LlamaModel
from kvpool.workers.monolithic import greedy_generate
from kvpool.workers.request import GenerationRequest

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'

BACKEND = "cuda" if torch.cuda.is_available() else "cpu"
BS = 8


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-tier-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tiers(url: str) -> dict[str, dict[str, int]]:
    with http_client(url, None, 5.0) as http:
        return http.get("/stats").json()["tiers"]


def test_tokens_equal_whether_the_prefix_was_computed_or_came_from_either_tier(workdir: Path) -> None:
    """Both block layouts of the copies are tested in tests/server/books/test_hosttier.py; here the default one."""
    layout = layout_for(TINY, BS, "float32", "layer_major")
    rng = random.Random(3)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(5 * BS + 3)]
    fillers = [[rng.randrange(TINY.vocab_size) for _ in range(5 * BS + 3)] for _ in range(4)]
    max_new = 6
    model_args = ["--random-model", "--seed", "0"]
    pool = demo.start_pool(layout, 16, workdir, BACKEND, "tiny-tier", extra=["--host-blocks", "64"])
    records, tiers = [], []
    try:
        for i, batch in enumerate([[prompt], fillers, [prompt], [prompt]]):
            requests = [GenerationRequest(f"run{i}-{j}", p, max_new) for j, p in enumerate(batch)]
            run_dir = workdir / f"run{i}"
            run_dir.mkdir()
            flow = demo.run_workers(pool.url, model_args, requests, run_dir)
            records.append((flow.prefill[0] if len(batch) == 1 else None, flow.tokens()))
            tiers.append(_tiers(pool.url))
    finally:
        pool.stop()
    computed, from_host, from_gpu = (records[i] for i in (0, 2, 3))
    assert computed[0] is not None and computed[0]["hit_tokens"] == 0
    assert from_host[0] is not None and from_host[0]["hit_tokens"] == 5 * BS
    assert tiers[2]["host"]["hit_blocks"] - tiers[1]["host"]["hit_blocks"] == 5, tiers
    assert tiers[2]["gpu"]["hit_blocks"] == tiers[1]["gpu"]["hit_blocks"], "the prefix was still in the arena"
    assert from_gpu[0] is not None and from_gpu[0]["hit_tokens"] == 5 * BS
    assert tiers[3]["gpu"]["hit_blocks"] - tiers[2]["gpu"]["hit_blocks"] == 5
    tokens = [r[1][f"run{i}-0"] for i, r in zip((0, 2, 3), (computed, from_host, from_gpu), strict=True)]
    assert tokens[0] == tokens[1] == tokens[2]
    model = LlamaModel.random(TINY, seed=0, device=torch.device(BACKEND))
    reference = greedy_generate(model, [prompt], max_new, layout)
    assert tokens[0] == reference[0]
    for t in tiers[-1].values():
        assert t["free"] + t["in_use"] + t["cached"] == t["num_blocks"] and t["in_use"] == 0
