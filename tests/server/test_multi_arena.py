"""A pool of several arenas (one per device), exercised on CPU arenas: ids, books, prefix chains, moves."""

from __future__ import annotations

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import InvalidRequest
from tests.conftest import local_pool


@pytest.fixture
def two_arenas():
    pool = local_pool(
        "--devices", "0,1", "--num-blocks", "16", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
        "--block-size", "4", "--dtype", "float32",
    )  # fmt: skip
    yield pool
    pool.stop()


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_each_device_has_its_own_id_range_books_and_prefix_chains(two_arenas, fast):
    with PoolClient(two_arenas.url, name="multi", fast=fast) as pool:
        desc = pool.descriptor()
        assert [(p.index, p.first_block, p.num_blocks) for p in desc.arenas] == [(0, 0, 16), (1, 16, 16)]
        on0, on1 = pool.alloc(2), pool.alloc(2, device=1)
        assert on0 == [0, 1] and on1 == [16, 17]
        pool.commit(on1, list(range(8)))
        assert pool.lookup(list(range(8)), device=1).block_ids == on1
        with pytest.raises(InvalidRequest, match="no arena on device 7"):
            pool.alloc(1, device=7)
        with pytest.raises(InvalidRequest, match="span several devices"):
            pool.commit([on0[0], on1[0]], list(range(8)))
        copied = pool.lookup(list(range(8))).block_ids  # device 0 had no such prefix: it gets a copy of device 1's
        assert len(copied) == 2 and all(b < 16 for b in copied) and pool.stats()["counters"]["peer_copies"] == 1
        assert pool.lookup(list(range(8))).block_ids == copied  # and holds it from then on
        pool.free(copied + copied + on1 + on1)
        stats = pool.stats()
        assert stats["num_blocks"] == 32
        assert stats["arenas"] == [
            {"free": 12, "in_use": 2, "cached": 2, "quarantined": 0},
            {"free": 14, "in_use": 0, "cached": 2, "quarantined": 0},
        ]


def test_move_copies_every_layer_of_the_blocks_to_the_other_arena(two_arenas):
    with PoolClient(two_arenas.url, name="mover") as pool:
        a0, a1 = pool.arena(device=0), pool.arena(device=1)
        assert a1.first_block == 16 and a0.raw.data_ptr() != a1.raw.data_ptr()
        src = pool.alloc(3, device=1)
        torch.manual_seed(0)
        want = [(torch.randn_like(a1.k(i)[0]), torch.randn_like(a1.v(i)[0])) for i in range(2)]
        local = a1.local_ids(src)
        for i, (k, v) in enumerate(want):
            a1.k(i)[local[1]] = k
            a1.v(i)[local[1]] = v
        moved = pool.move(src, device=0)
        assert all(0 <= b < 16 for b in moved)
        for i, (k, v) in enumerate(want):
            assert torch.equal(a0.k(i)[moved[1]], k) and torch.equal(a0.v(i)[moved[1]], v)
        s = pool.stats()
        assert s["arenas"][1]["in_use"] == 0 and s["arenas"][0]["in_use"] == 3


@pytest.mark.slow
def test_prefill_on_one_arena_and_decode_on_another_give_the_monolithic_tokens():
    """The demo's check, across arenas: the decode claims blocks of arena 0 and moves them into arena 1."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    run = subprocess.run(
        [sys.executable, "-m", "kvpool.workers.demo", "--backend", "cpu", "--devices", "0,1", "--max-new-tokens", "6",
         "--json"],
        capture_output=True, text=True, timeout=240, env=child_env(), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["all_match"] is True and summary["blocks_in_use_after"] == 0, summary
    assert all(r["match"] for r in summary["requests"])
