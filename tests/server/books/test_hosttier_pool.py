"""A real pool with a host tier (a second /dev/shm arena on the cpu backend): a worker's KV survives eviction."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvpool.client import PoolClient
from kvpool.errors import KvpoolError
from kvpool.hosttier import open_host_tier
from kvpool.layout import KVLayout
from kvpool.server.config import describe_error
from kvpool.slab import SlabClient, SlabConfig
from tests.conftest import local_pool
from tests.server.events.test_metrics import promtool_problems

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
FLAGS = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "4", "--dtype", "float32")


def test_a_prefix_evicted_to_the_host_comes_back_with_the_kv_the_worker_wrote() -> None:
    pool = local_pool(*FLAGS, "--num-blocks", "8", "--host-blocks", "24")
    try:
        with PoolClient(pool.url, name="w", role="prefill", layout=LAYOUT) as client:
            arena = client.arena()
            prompts = [[p * 100 + t for t in range(16)] for p in range(4)]  # 4 blocks each: 16 blocks, arena of 8
            for p, tokens in enumerate(prompts):
                ids = client.alloc(4)
                for i, b in enumerate(ids):
                    for t in arena.block(b):
                        t.fill_(p * 10 + i + 1)
                client.commit(ids, tokens)
                client.free(ids)
            host = open_host_tier(arena.descriptor, pin=False)  # what a worker maps, as the pool does
            assert host.shape == (24, 2 * LAYOUT.num_layers, LAYOUT.block_layer_elems)
            firsts = {float(host[b, 0, 0]) for b in range(24)}
            assert firsts <= {0.0} | {p * 10 + i + 1 for p in range(4) for i in range(4)} and len(firsts) > 8
            for p, tokens in enumerate(prompts):
                hit = client.lookup(tokens)
                assert hit.num_tokens == 16
                got = [float(arena.block(b)[0].flatten()[0]) for b in hit.block_ids]
                assert got == [p * 10 + i + 1 for i in range(4)]
                client.free(hit.block_ids)
        with pool.http() as http:
            stats = http.get("/stats").json()
            metrics = http.get("/metrics").text
    finally:
        pool.stop()
    tiers = stats["tiers"]
    for t in tiers.values():
        assert t["free"] + t["in_use"] + t["cached"] + t.get("quarantined", 0) == t["num_blocks"]
    assert tiers["host"]["num_blocks"] == 24 and tiers["host"]["hit_blocks"] >= 8
    assert tiers["host"]["restored_bytes"] == tiers["host"]["restored_blocks"] * LAYOUT.block_nbytes > 0
    assert stats["counters"]["hit_blocks"] == 16
    assert promtool_problems(metrics) == []
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    hits = {s.labels["tier"]: s.value for s in families["kvpool_tier_hit_blocks"].samples}
    assert hits == {"gpu": tiers["gpu"]["hit_blocks"], "host": tiers["host"]["hit_blocks"]}
    moved = {s.labels["direction"]: s.value for s in families["kvpool_host_tier_copied_bytes"].samples}
    assert moved["restore"] == tiers["host"]["restored_bytes"]


def test_a_slab_that_evicts_a_prefix_never_hands_its_own_kv_to_the_prefixs_next_hit() -> None:
    """A slab's refill evicts cached prefix blocks like any alloc: their KV must reach the host before the slab's
    owner writes into them, or the next lookup restores the owner's bytes as the prefix (another tenant's KV)."""
    pool = local_pool(*FLAGS, "--num-blocks", "16", "--host-blocks", "24", "--slabs", "--slab-max-blocks", "16")
    try:
        with PoolClient(pool.url, name="a", layout=LAYOUT) as a:
            arena = a.arena()
            prompt = list(range(16))  # 4 blocks
            ids = a.alloc(4)
            for b in ids:
                for t in arena.block(b):
                    t.fill_(1.0)
            a.commit(ids, prompt)
            a.free(ids)
            with SlabClient(pool.url, name="b", layout=LAYOUT, slab=SlabConfig(blocks=16, low=0, high=16)) as b:
                theirs = [b.alloc(1)[0] for _ in range(16)]  # one refill of the whole arena: the prefix is evicted
                assert b.slab is not None and pool.stats()["cached"] == 0
                for block in theirs:
                    for t in b.arena().block(block):
                        t.fill_(9.0)
                b.free(theirs)
            a.free(a.alloc(1))  # any later call that evicts or allocates copies what was queued for the host
            hit = a.lookup(prompt)
            assert hit.num_tokens == 16
            assert [float(arena.block(block)[0].flatten()[0]) for block in hit.block_ids] == [1.0] * 4
            a.free(hit.block_ids)
        stats = pool.stats()
        assert stats["free"] + stats["in_use"] + stats["cached"] == stats["num_blocks"]
    finally:
        pool.stop()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--host-blocks", "4", "--host-bytes", "1MiB"), "one way only"),
        (("--host-blocks", "0"), "host-blocks"),
        (("--host-bytes", "100"), "holds no block"),
    ],
)
def test_a_bad_host_tier_size_is_refused_with_what_to_do(flags: tuple[str, ...], says: str) -> None:
    """What ``kvpool serve`` prints: the settings' own line (as its ``main`` words it), or the refusal to start."""
    try:
        local_pool(*FLAGS, "--num-blocks", "8", *flags).stop()
    except ValidationError as exc:
        refusal = describe_error(exc)
    except KvpoolError as exc:
        refusal = str(exc)
    else:
        raise AssertionError(f"a pool started with {flags}")
    assert says in refusal, refusal
