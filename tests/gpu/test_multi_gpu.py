"""Two GPUs, one pool: an arena per device, mapped by UUID, blocks moved GPU to GPU by ids."""

from __future__ import annotations

import pytest
import torch

from kvpool.client import PoolClient
from tests.conftest import start_pool
from tests.gpu.blocks import fill, read

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.fixture
def gpu_pair_pool():
    pool = start_pool(
        "--backend", "cuda", "--devices", "0,1", "--num-blocks", "512", "--num-layers", "8", "--num-kv-heads", "4",
        "--head-dim", "128", "--block-size", "16", "--dtype", "bfloat16",
    )  # fmt: skip
    yield pool
    pool.stop()


def test_each_arena_lives_on_its_gpu_and_moves_keep_every_byte(gpu_pair_pool):
    with PoolClient(gpu_pair_pool.url, name="pair") as pool:
        desc = pool.descriptor()
        uuids = [p.device.uuid for p in desc.arenas if p.device is not None]
        assert len(set(uuids)) == 2
        a0, a1 = pool.arena(device=0), pool.arena(device=1)
        assert (a0.device, a1.device) == (torch.device("cuda:0"), torch.device("cuda:1"))
        src = pool.alloc(64, device=0)
        payload = fill(a0, src)
        moved = pool.move(src, device=1)
        torch.cuda.synchronize(1)
        assert torch.equal(read(a1, moved), payload)
        assert pool.stats()["arenas"][0]["in_use"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_on_gpu0_and_decode_on_gpu1_match_a_single_gpu_run(dtype):
    """`kvpool demo --devices 0,1`: exits non-zero unless every request's tokens equal the monolithic run's."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    run = subprocess.run(
        [sys.executable, "-m", "kvpool.workers.demo", "--backend", "cuda", "--devices", "0,1", "--dtype", dtype,
         "--json"],
        capture_output=True, text=True, timeout=300, env=child_env(), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["all_match"] is True and summary["blocks_in_use_after"] == 0
