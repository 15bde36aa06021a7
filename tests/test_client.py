"""The client against a real pool process: two processes, one arena, block ids only."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import HandoffNotFound, LayoutMismatch, NotOwner
from kvpool.layout import KVLayout
from tests.conftest import child_env

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "tests.pattern_worker", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_pattern_written_by_one_process_is_read_by_another(pool_server):
    w = run_worker("write", pool_server.url, "req-1", "5")
    assert w.returncode == 0, w.stderr
    r = run_worker("read", pool_server.tcp_url, "req-1", "5")
    assert r.returncode == 0 and "READ OK" in r.stdout, r.stdout + r.stderr
    s = pool_server.stats()
    assert (s["free"], s["in_use"], s["handoffs"]) == (64, 0, 0)


def test_a_prefix_committed_by_one_process_is_found_and_read_by_another(pool_server):
    from tests.pattern_worker import pattern, prompt_tokens

    w = run_worker("commit", pool_server.url, "-", "4")
    assert w.returncode == 0, w.stderr
    written = [int(b) for b in w.stdout.split("WROTE", 1)[1].split()]
    with PoolClient(pool_server.url, name="reader", layout=SMALL) as pool:
        arena = pool.arena()
        shared = prompt_tokens(4, SMALL.block_size)[: 3 * SMALL.block_size]
        hit = pool.lookup([*shared, 999, 998, 997, 996, 995])
        assert hit.block_ids == written[:3] and hit.num_tokens == 3 * SMALL.block_size
        want = pattern(arena, written)
        for (layer, kv), values in zip([(i, kv) for i in range(SMALL.num_layers) for kv in (0, 1)], want, strict=True):
            view = arena.k(layer) if kv == 0 else arena.v(layer)
            assert torch.equal(view[hit.block_ids], values[:3])
        pool.free(hit.block_ids)
    assert pool_server.stats()["cached"] == 4


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_both_transports_give_the_same_answers(pool_server, fast):
    with PoolClient(pool_server.url, name="t", fast=fast) as pool:
        assert (pool._fast_path is not None) == fast
        ids = pool.alloc(3)
        assert pool.commit(ids, list(range(10))).committed == 2
        assert pool.lookup(list(range(8))).block_ids == ids[:2]
        with pytest.raises(NotOwner, match="holds no reference"):
            pool.free([ids[0]] * 3)
        assert pool.free(ids[:2]) == 2
        pool.handoff("r", ids, 10)
        assert pool.claim("r").block_ids == ids
        with pytest.raises(HandoffNotFound):
            pool.claim("r", timeout_s=0.05)


def test_claim_waits_for_the_handoff(pool_server):
    with PoolClient(pool_server.url, name="p") as prefill, PoolClient(pool_server.url, name="d") as decode:
        got = {}

        def wait() -> None:
            got["claim"] = decode.claim(timeout_s=10)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        ids = prefill.alloc(2)
        prefill.handoff("late", ids, 5)
        t.join(5)
        assert got["claim"].block_ids == ids and got["claim"].request_id == "late"


def test_views_alias_one_memory_across_clients_and_map_once(pool_server):
    with PoolClient(pool_server.url, name="a") as a, PoolClient(pool_server.tcp_url, name="b", fast=False) as b:
        arena = a.arena()
        assert b.arena() is arena  # one mapping per process
        ids = a.alloc(1)
        arena.k(1)[ids[0]].fill_(3.5)
        assert float(arena.raw.view(arena.k(0).dtype).sum()) == pytest.approx(3.5 * SMALL.block_layer_elems)
        assert arena.k(0).shape == (64, 4, 2, 8)


def test_a_model_with_another_layout_is_refused(pool_server):
    wrong = SMALL.model_copy(update={"head_dim": 16})
    with pytest.raises(LayoutMismatch, match="head_dim: pool 8 != yours 16"):
        PoolClient(pool_server.url, name="w", layout=wrong)
    with PoolClient(pool_server.url, name="ok", layout=SMALL) as pool:
        assert pool.arena().layout == SMALL
        with pytest.raises(LayoutMismatch, match="dtype"):
            pool.arena(SMALL.model_copy(update={"dtype": "bfloat16"}))
