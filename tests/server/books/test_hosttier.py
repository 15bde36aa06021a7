"""The host tier's books and copies, on CPU tensors: what the GPU runs, with the arena and the tier in memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpool.arena import Arena
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor
from kvpool.server.books.hosttier import HostTier
from kvpool.server.books.pool import Pool
from kvpool.server.tiers.tiercopy import TierCopier, runs

BS = 4


def make(order: str = "layer_major", gpu_blocks: int = 8, host_blocks: int = 16) -> tuple[Pool, Arena, HostTier]:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32", order=order)
    gpu_blocks += layout.reserved_blocks  # a kv_packed arena's block 0 is no one's: room for as many others
    raw = torch.zeros(gpu_blocks * layout.block_nbytes, dtype=torch.uint8)
    desc = ArenaDescriptor(
        epoch="t", backend="cpu", device=None, handle="", handle_kind="shm", nbytes=raw.numel(), num_blocks=gpu_blocks,
        block_nbytes=layout.block_nbytes, layout=layout, owner_pid=0,
    )  # fmt: skip
    arena = Arena(desc, raw)
    host = torch.zeros(host_blocks, 2 * layout.num_layers, layout.block_layer_elems)
    tier = HostTier(host_blocks, TierCopier([arena.blocks_view()], host))
    return Pool(gpu_blocks, layout, host_tier=tier), arena, tier


def fill(arena: Arena, block: int, value: float) -> None:
    for t in arena.block(block):
        t.fill_(value)


def value_of(arena: Arena, block: int) -> float:
    parts = arena.block(block)
    first = float(parts[0].flatten()[0])
    assert all(bool((t == first).all()) for t in parts), f"block {block} holds mixed KV"
    return first


def prompt(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n_blocks * BS)]


def expected(tokens: list[int], i: int) -> float:
    """The KV a block 'computes' to: a function of its whole prefix, as real KV is."""
    return float(hash(tuple(tokens[: (i + 1) * BS])) % 9973)


def store(pool: Pool, arena: Arena, sid: str, tokens: list[int]) -> list[int]:
    ids = pool.alloc(sid, len(tokens) // BS)
    for i, b in enumerate(ids):
        fill(arena, b, expected(tokens, i))
    pool.commit(sid, ids, tokens)
    pool.free(sid, ids)
    return ids


def balanced(pool: Pool, tier: HostTier) -> None:
    pool.allocator.check()
    tier.check()
    tiers = pool.stats()["tiers"]
    for t in tiers.values():
        assert t["free"] + t["in_use"] + t["cached"] == t["num_blocks"], tiers


@pytest.mark.parametrize("order", ["layer_major", "block_major", "kv_packed"])
def test_an_evicted_prefix_moves_to_the_host_and_comes_back_with_its_kv(order: str) -> None:
    pool, arena, tier = make(order)
    sid = pool.open_session("w", "prefill").session_id
    first = prompt(1, 4)
    store(pool, arena, sid, first)
    store(pool, arena, sid, prompt(2, 4))
    ids = pool.alloc(sid, 8)  # evicts both prompts: 8 blocks offloaded in one batch
    s = pool.stats()["tiers"]["host"]
    assert (s["cached"], s["offloaded_blocks"], s["offloaded_bytes"]) == (8, 8, 8 * pool.layout.block_nbytes)
    for b in ids:
        fill(arena, b, -1.0)  # the new owner overwrites what the evicted blocks held
    pool.free(sid, ids)
    hit = pool.lookup(sid, [*first, 7])
    assert hit.num_tokens == 4 * BS
    assert [value_of(arena, b) for b in hit.block_ids] == [expected(first, i) for i in range(4)]
    s = pool.stats()
    assert s["tiers"]["host"]["hit_blocks"] == 4 and s["tiers"]["gpu"]["hit_blocks"] == 0
    assert s["tiers"]["host"]["cached"] == 4  # the other prompt is still on the host; the restored one moved back
    balanced(pool, tier)
    again = pool.lookup(sid, first)  # now a GPU hit: the same blocks, no copy
    assert again.block_ids == hit.block_ids and pool.stats()["tiers"]["gpu"]["hit_blocks"] == 4
    pool.free(sid, hit.block_ids + again.block_ids)
    balanced(pool, tier)


def test_without_a_host_tier_the_prefix_is_lost() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32")
    pool = Pool(8, layout)
    sid = pool.open_session("w", "prefill").session_id
    first = prompt(1, 8)
    ids = pool.alloc(sid, 8)
    pool.commit(sid, ids, first)
    pool.free(sid, ids)
    pool.free(sid, pool.alloc(sid, 8))
    assert pool.lookup(sid, first).num_tokens == 0
    assert set(pool.stats()["tiers"]) == {"gpu"}


def test_a_full_host_tier_evicts_its_least_recently_used_chains_tail_first() -> None:
    pool, arena, tier = make(gpu_blocks=4, host_blocks=6)
    sid = pool.open_session("w", "prefill").session_id
    a, b, c = prompt(1, 3), prompt(2, 3), prompt(3, 3)
    store(pool, arena, sid, a)
    store(pool, arena, sid, b)  # a goes to the host (3 blocks)
    store(pool, arena, sid, c)  # b goes to the host: the host is full
    pool.free(sid, pool.alloc(sid, 4))  # c goes, and a (least recently used) leaves the host for it
    assert pool.stats()["tiers"]["host"]["evictions"] == 3
    assert pool.lookup(sid, a).num_tokens == 0
    got = pool.lookup(sid, c)
    assert [value_of(arena, x) for x in got.block_ids] == [expected(c, i) for i in range(3)]
    pool.free(sid, got.block_ids)
    balanced(pool, tier)


def test_a_restore_takes_only_what_the_arena_has_room_for() -> None:
    pool, arena, tier = make(gpu_blocks=4, host_blocks=8)
    sid = pool.open_session("w", "prefill").session_id
    a = prompt(1, 4)
    store(pool, arena, sid, a)
    held = pool.alloc(sid, 2)  # a's two tail blocks go to the host; its first two stay cached in the arena
    got = pool.lookup(sid, a)  # the two cached ones take the arena's last room: nothing is left to restore into
    assert got.num_tokens == 2 * BS
    assert pool.stats()["tiers"]["host"]["cached"] == 2
    pool.free(sid, held + got.block_ids)
    got = pool.lookup(sid, a)
    assert [value_of(arena, x) for x in got.block_ids] == [expected(a, i) for i in range(4)]
    pool.free(sid, got.block_ids)
    balanced(pool, tier)


def test_runs_cut_sorted_ids_into_consecutive_stretches() -> None:
    assert runs([1, 2, 3, 7, 8, 10]) == [(1, 0, 3), (7, 3, 2), (10, 5, 1)]
    assert runs([]) == []


def test_random_workload_never_hands_back_other_kv_and_the_books_balance() -> None:
    """Stores, lookups and allocations at random over 3x the arena: every hit's KV is its prefix's, either tier."""
    pool, arena, tier = make(gpu_blocks=12, host_blocks=24)
    rng = random.Random(7)
    sid = pool.open_session("w", "prefill").session_id
    prompts = [prompt(i, rng.randrange(1, 5)) for i in range(20)]
    hits = {"gpu": 0, "host": 0}
    for _ in range(300):
        p = rng.choice(prompts)
        before = pool.stats()["tiers"]
        got = pool.lookup(sid, p)
        after = pool.stats()["tiers"]
        for t in hits:
            hits[t] += after[t]["hit_blocks"] - before[t]["hit_blocks"]
        assert [value_of(arena, b) for b in got.block_ids] == [expected(p, i) for i in range(len(got.block_ids))]
        rest = len(p) // BS - len(got.block_ids)
        if rest and pool.allocator.available(0) >= rest:
            new = pool.alloc(sid, rest)
            for i, b in enumerate(new, start=len(got.block_ids)):
                fill(arena, b, expected(p, i))
            pool.commit(sid, got.block_ids + new, p)
            got.block_ids += new
        pool.free(sid, got.block_ids)
        balanced(pool, tier)
    assert hits["gpu"] > 0 and hits["host"] > 0, hits


def test_kv_events_keep_a_router_exact_while_prefixes_move_to_the_host_and_leave_it() -> None:
    """A block offloaded to the host stays findable on the node, so it stays announced; when the host tier
    drops it, the key finds nothing and a router must hear BlockRemoved."""
    pytest.importorskip("msgspec")
    from kvpool.server.events.feed import media_of
    from kvpool.server.events.kvevents import IndexEvents
    from tests.server.events.test_kvevents import Recorder, assert_mirrors

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32", order="layer_major")
    _, arena, tier = make(gpu_blocks=4, host_blocks=6)
    recorder = Recorder()
    listener = IndexEvents(recorder.put, BS, [0], media_of("cuda", 1))
    pool = Pool(4, layout, host_tier=tier, index_listener=listener)
    sid = pool.open_session("w", "prefill").session_id
    a, b, c = prompt(1, 3), prompt(2, 3), prompt(3, 3)
    for tokens in (a, b, c):
        store(pool, arena, sid, tokens)
        assert_mirrors(pool, recorder, [0])
    assert len(recorder.router.blocks) == 9  # a and b on the host, c in the arena: all findable
    pool.free(sid, pool.alloc(sid, 4))  # a leaves the host for c
    assert_mirrors(pool, recorder, [0])
    assert len(recorder.router.blocks) == 6
    balanced(pool, tier)


def test_every_taker_of_blocks_copies_what_it_evicted_before_the_blocks_reach_anyone(tmp_path: Path) -> None:
    """An alloc, a slab's refill and a restore all take blocks through the allocator, which flushes what they
    evicted before it returns them: the taker's writes can never reach the host as the evicted prefix's KV."""
    pool, arena, tier = make(gpu_blocks=8, host_blocks=16)
    books = pool.open_slabs(tmp_path, regions=2, slots=8, box_dir=None)
    try:
        a = pool.open_session("a", "other").session_id
        b = pool.open_session("b", "other").session_id
        books.open(b)
        tokens = prompt(1, 4)
        store(pool, arena, a, tokens)
        slab = books.grant(b, 8, [])  # the whole arena: the prefix is evicted into the host's queue
        tier.check()  # the queue was copied before grant returned
        for block in slab:
            fill(arena, block & 0xFFFFFFFF, -1.0)
        books.grant(b, 0, slab)
        hit = pool.lookup(a, tokens)
        assert [value_of(arena, block) for block in hit.block_ids] == [expected(tokens, i) for i in range(4)]
        tier.check()
        pool.allocator.check()
    finally:
        books.close()


def test_a_failed_copy_to_the_host_takes_back_the_blocks_it_was_evicting_for() -> None:
    pool, arena, tier = make(gpu_blocks=4, host_blocks=8)
    a = pool.open_session("a", "other").session_id
    tokens = prompt(2, 4)
    store(pool, arena, a, tokens)

    def broken(*_: object) -> None:
        raise RuntimeError("copy failed")

    tier.copier.offload = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.alloc(a, 2)
    assert pool.allocator.held(f"s:{a}") == {}  # the caller holds nothing it was never told of
    hit = pool.lookup(a, tokens)  # the two blocks it evicted are gone (not served stale), the chain's head is not
    assert [value_of(arena, block) for block in hit.block_ids] == [expected(tokens, i) for i in range(2)]
    pool.allocator.check()
