"""Prefixes across the arenas of one pool (one per GPU): a lookup on one arena served from another by one batched
copy, indexed there, each copy evicted on its own, a prefix's last copy evicted last."""

from __future__ import annotations

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from tests.conftest import SMALL_POOL, local_pool

BS = 4


class Arenas:
    """Two arenas' KV as one value a block, and the copies the pool asked for."""

    def __init__(self, sizes: list[int]) -> None:
        self.kv: list[list[object]] = [[None] * n for n in sizes]
        self.calls: list[tuple[int, list[int], int, list[int]]] = []
        self.fail = False

    def copy(self, src: int, src_ids: list[int], dst: int, dst_ids: list[int]) -> None:
        if self.fail:
            raise RuntimeError("the copy failed")
        self.calls.append((src, list(src_ids), dst, list(dst_ids)))
        for s, d in zip(src_ids, dst_ids, strict=True):
            self.kv[dst][d] = self.kv[src][s]


def make(sizes: tuple[int, int] = (8, 8)) -> tuple[Pool, Arenas]:
    arenas = Arenas(list(sizes))
    return Pool(list(sizes), KVLayout(block_size=BS), peer_copy=arenas.copy), arenas


def store(pool: Pool, arenas: Arenas, tokens: list[int], arena: int) -> list[int]:
    """A prompt's full blocks computed on ``arena`` (each holds what its prefix computes to), committed, freed."""
    sid = pool.open_session("w", "prefill").session_id
    blocks = pool.unfence(pool.alloc(sid, len(tokens) // BS, arena=arena))
    start = pool.allocator.starts[arena]
    for i, b in enumerate(blocks):
        arenas.kv[arena][b - start] = tuple(tokens[: (i + 1) * BS])
    pool.commit(sid, pool.allocator.fenced(blocks), tokens)
    pool.close_session(sid)
    return blocks


def held_kv(pool: Pool, arenas: Arenas, fenced: list[int]) -> list[object]:
    blocks = pool.unfence(fenced)
    return [
        arenas.kv[pool.allocator.arena_of[b]][b - pool.allocator.starts[pool.allocator.arena_of[b]]] for b in blocks
    ]


def test_a_prefix_on_one_gpu_is_copied_to_another_once_and_found_there_after() -> None:
    pool, arenas = make()
    tokens = list(range(12))
    src = store(pool, arenas, tokens, arena=0)
    sid = pool.open_session("r", "decode").session_id
    hit = pool.lookup(sid, tokens, arena=1)
    copies = pool.unfence(hit.block_ids)
    assert hit.num_tokens == 12 and all(pool.allocator.arena_of[b] == 1 for b in copies)
    assert held_kv(pool, arenas, hit.block_ids) == [tuple(tokens[:4]), tuple(tokens[:8]), tuple(tokens)]
    assert arenas.calls == [(0, [b for b in src], 1, [b - 8 for b in copies])]  # one batched copy
    again = pool.lookup(sid, tokens, arena=1)
    assert again.block_ids == hit.block_ids and len(arenas.calls) == 1  # indexed there: a plain hit now
    assert all(pool.allocator.spare[b] for b in [*src, *copies])
    c = pool.counters
    assert (c.peer_copies, c.peer_copied_blocks, c.hit_blocks) == (1, 3, 6)
    pool.close_session(sid)
    pool.allocator.check()


def test_only_the_blocks_past_the_local_prefix_are_copied() -> None:
    pool, arenas = make()
    tokens = list(range(100, 116))
    store(pool, arenas, tokens, arena=0)
    local = store(pool, arenas, tokens[:4], arena=1)
    sid = pool.open_session("r", "decode").session_id
    hit = pool.lookup(sid, tokens, arena=1)
    assert pool.unfence(hit.block_ids)[0] == local[0] and hit.num_tokens == 16
    assert [len(call[1]) for call in arenas.calls] == [3]
    assert held_kv(pool, arenas, hit.block_ids) == [tuple(tokens[: (i + 1) * BS]) for i in range(4)]
    pool.allocator.check()


def test_an_arena_evicts_its_copies_before_the_node_s_only_copies() -> None:
    pool, arenas = make()
    shared, own = list(range(200, 212)), list(range(300, 312))
    src = store(pool, arenas, shared, arena=0)
    sole = store(pool, arenas, own, arena=1)
    sid = pool.open_session("r", "decode").session_id
    copies = pool.unfence(pool.lookup(sid, shared, arena=1).block_ids)
    pool.free(sid, pool.allocator.fenced(copies))
    taken = pool.unfence(pool.alloc(sid, 5, arena=1))  # 2 free blocks of 8, then 3 evicted: the copies
    assert set(copies) <= set(taken) and not set(sole) & set(taken)
    assert not any(pool.allocator.spare[b] for b in src), "arena 0's blocks are the node's only copies again"
    assert pool.lookup(sid, own, arena=1).num_tokens == 12
    pool.allocator.check()


def test_no_room_or_a_failed_copy_gives_the_local_prefix_and_changes_nothing_else() -> None:
    pool, arenas = make((8, 4))
    tokens = list(range(400, 416))
    store(pool, arenas, tokens, arena=0)
    sid = pool.open_session("r", "decode").session_id
    hold = pool.alloc(sid, 4, arena=1)  # arena 1 is full of blocks in use
    assert pool.lookup(sid, tokens, arena=1).num_tokens == 0 and not arenas.calls
    pool.free(sid, hold)
    arenas.fail = True
    assert pool.lookup(sid, tokens, arena=1).num_tokens == 0
    s = pool.stats()
    assert s["counters"]["peer_copies"] == 0 and s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
    assert s["in_use"] == 0  # the copy's blocks went back, and its sources' pins
    pool.allocator.check()


def test_without_a_copier_a_lookup_stays_in_its_arena() -> None:
    pool = Pool([8, 8], KVLayout(block_size=BS))
    sid = pool.open_session("w", "prefill").session_id
    ids = pool.alloc(sid, 2, arena=0)
    pool.commit(sid, ids, list(range(8)))
    assert pool.peers is None and pool.lookup(sid, list(range(8)), arena=1).num_tokens == 0


@pytest.mark.parametrize("order", ["layer_major", "kv_packed"])
def test_a_pool_of_two_arenas_copies_the_kv_itself(order: str) -> None:
    """A served pool with two arenas (two files without CUDA; two GPUs with it): the KV a writer put in arena 0 is
    what a reader finds in arena 1's blocks."""
    proc = local_pool(*SMALL_POOL, "--devices", "0,1", "--order", order)
    try:
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", order=order)
        with PoolClient(proc.url, name="w", layout=layout) as w, PoolClient(proc.url, name="r", layout=layout) as r:
            tokens = list(range(500, 512))
            ids = w.alloc(3, device=0)
            a0, a1 = w.arena(device=0), r.arena(device=1)
            for i, local in enumerate(a0.local_ids(ids)):
                for layer in range(2):
                    a0.k(layer)[local].fill_(float(i + 1))
                    a0.v(layer)[local].fill_(-float(i + 1))
            w.commit(ids, tokens)
            w.free(ids)
            hit = r.lookup(tokens, device=1)
            assert hit.num_tokens == 12
            for i, local in enumerate(a1.local_ids(hit.block_ids)):
                for layer in range(2):
                    assert torch.all(a1.k(layer)[local] == float(i + 1)) and torch.all(a1.v(layer)[local] == -i - 1)
            assert r.stats()["counters"]["peer_copied_blocks"] == 3
            r.free(hit.block_ids)
    finally:
        proc.stop()


def test_a_prefix_whose_blocks_went_to_the_host_tier_is_not_copied_from_its_stale_arena_blocks() -> None:
    """With a host tier, a chain's evicted blocks live on the host: their arena blocks hold another prefix's KV by
    now, so a copy to another arena stops where the arena's part of the chain stops."""
    from kvpool.server.books.hosttier import HostTier
    from kvpool.server.tiers.tiercopy import TierCopier

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32")
    views = [(torch.zeros(1, 8, 2 * BS * 2), 1), (torch.zeros(1, 8, 2 * BS * 2), 1)]
    tier = HostTier(8, TierCopier(views, torch.zeros(8, 2, BS * 2)))
    arenas = Arenas([8, 8])
    pool = Pool([8, 8], layout, host_tier=tier, peer_copy=arenas.copy)
    tokens = list(range(600, 612))
    store(pool, arenas, tokens, arena=0)
    sid = pool.open_session("x", "other").session_id
    pool.free(sid, pool.alloc(sid, 8, arena=0))  # evicts the prompt's three blocks to the host tier
    assert pool.lookup(sid, tokens, arena=1).num_tokens == 0 and not arenas.calls
    pool.allocator.check()


@pytest.mark.parametrize("dim", [0, 1])
def test_the_arena_copier_moves_each_block_whole_into_its_target_and_touches_nothing_else(dim: int) -> None:
    from kvpool.server.tiers.tiercopy import ArenaCopier

    shape = (lambda n: (n, 3, 5)) if dim == 0 else (lambda n: (3, n, 5))
    src = torch.arange(torch.Size(shape(10)).numel(), dtype=torch.float32).reshape(shape(10))
    dst = torch.full(shape(6), -1.0)
    ArenaCopier([(src, dim), (dst, dim)]).copy(0, [7, 8, 2], 1, [0, 1, 5])
    for s, d in ((7, 0), (8, 1), (2, 5)):
        assert torch.equal(dst.select(dim, d), src.select(dim, s))
    assert torch.all(dst.index_select(dim, torch.tensor([2, 3, 4])) == -1.0)
    with pytest.raises(ValueError, match="2 source blocks against 1"):
        ArenaCopier([(src, dim), (dst, dim)]).copy(0, [1, 2], 1, [0])


def test_a_burst_s_prefixes_from_another_gpu_come_in_one_copy_and_a_shared_one_is_copied_once() -> None:
    pool, arenas = make((32, 32))
    a, b, shared = list(range(0, 12)), list(range(50, 58)), list(range(200, 208))
    for tokens in (a, b, shared):
        store(pool, arenas, tokens, arena=0)
    sid = pool.open_session("r", "decode").session_id
    prompts = [a, b, [*shared, 1, 2, 3, 4, 5], shared]
    hits = pool.lookup_many(sid, [(t, None) for t in prompts], arena=1)
    assert [h.num_tokens for h in hits] == [12, 8, 8, 8]
    assert len(arenas.calls) == 1, "one copy for the whole burst"
    for h, t in zip(hits, prompts, strict=True):
        assert all(pool.allocator.arena_of[x] == 1 for x in pool.unfence(h.block_ids))
        assert held_kv(pool, arenas, h.block_ids) == [tuple(t[: (i + 1) * BS]) for i in range(h.num_tokens // BS)]
    assert hits[2].block_ids == hits[3].block_ids, "the second finds the first's copies"
    assert (pool.counters.peer_copies, pool.counters.peer_copied_blocks) == (3, 7)
    pool.close_session(sid)
    pool.allocator.check()


def test_a_burst_whose_copy_fails_gets_its_local_prefixes_only_and_the_books_balance() -> None:
    pool, arenas = make((32, 32))
    tokens = list(range(300, 316))
    store(pool, arenas, tokens, arena=0)
    local = store(pool, arenas, tokens[:4], arena=1)
    arenas.fail = True
    sid = pool.open_session("r", "decode").session_id
    hits = pool.lookup_many(sid, [(tokens, None), (tokens[:12], None)], arena=1)
    assert [pool.unfence(h.block_ids) for h in hits] == [local, local]
    assert (pool.counters.peer_copies, pool.counters.peer_copied_blocks) == (0, 0)
    pool.close_session(sid)
    pool.allocator.check()
    assert not any(pool.allocator.ref_cnt), "no block held once the session is gone: the failed copies went back"
    arenas.fail = False
    sid = pool.open_session("r2", "decode").session_id
    again = pool.lookup(sid, tokens, arena=1)
    assert again.num_tokens == 16 and held_kv(pool, arenas, again.block_ids)[-1] == tuple(tokens)
    pool.close_session(sid)
    pool.allocator.check()
