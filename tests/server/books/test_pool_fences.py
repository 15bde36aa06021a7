"""The books with fenced ids: every call that names blocks refuses a stale id and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvpool.errors import HandoffRefused, StaleBlock, UnknownSession
from kvpool.ids import block_of, generation_of
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from tests.server.books.test_pool import Clock, balanced

BS = 4


def make_pool(clock: Clock, n: int = 4) -> Pool:
    return Pool(n, KVLayout(block_size=BS), lease_ttl_s=2.0, handoff_ttl_s=5.0, clock=clock)


def snapshot(pool: Pool) -> tuple[Any, ...]:
    a = pool.allocator
    held = {h: dict(v) for h, v in a._holders.items()}
    return pool.stats()["arenas"], held, list(a.generation), sorted(pool.handoffs), len(pool.index)


def recycled(pool: Pool, sid: str) -> tuple[int, int]:
    """An id of ``sid``'s that went stale (its block freed, then allocated again to ``sid``) and the current one."""
    (old,) = pool.alloc(sid, 1)
    pool.free(sid, [old])
    while True:
        (new,) = pool.alloc(sid, 1)
        if block_of(new) == block_of(old):
            return old, new


CALLS: dict[str, Callable[[Pool, str, int], object]] = {
    "free": lambda pool, sid, stale: pool.free(sid, [stale]),
    "commit": lambda pool, sid, stale: pool.commit(sid, [stale], list(range(BS))),
    "handoff": lambda pool, sid, stale: pool.handoff(sid, "req-stale", [stale], 1),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_stale_id_is_refused_on_every_call_that_names_blocks(call):
    """The session holds the block again, under a newer generation: the old id must not act on the new grant."""
    pool = make_pool(Clock())
    sid = pool.open_session("w", "prefill").session_id
    old, new = recycled(pool, sid)
    assert generation_of(new) == generation_of(old) + 1
    before = snapshot(pool)
    with pytest.raises(StaleBlock, match="stale") as refused:
        CALLS[call](pool, sid, old)
    assert refused.value.stale == (old,)
    assert snapshot(pool) == before
    assert pool.counters.stale_refused == 1 and pool.stats()["counters"]["stale_ids"] == 1
    CALLS[call](pool, sid, new)  # the current id does what the stale one could not
    assert balanced(pool)


def test_an_addressed_handoff_with_a_stale_id_is_refused_and_its_claim_told():
    pool = make_pool(Clock())
    p = pool.open_session("prefill", "prefill").session_id
    d = pool.open_session("decode", "decode").session_id
    old, _ = recycled(pool, p)
    with pytest.raises(StaleBlock):
        pool.handoff(p, "req-1", [old], 1, to="decode")
    with pytest.raises(HandoffRefused, match="StaleBlock"):
        pool.claim(d, "req-1")


def test_ids_carry_the_generation_of_their_grant_on_every_way_out():
    """alloc, lookup and claim all hand out the block's current generation; a cached block keeps its generation
    (its KV is still what it was), an evicted one moves on."""
    clock = Clock()
    pool = make_pool(clock, n=2)
    s = pool.open_session("s", "prefill").session_id
    t = pool.open_session("t", "decode").session_id
    _, a = recycled(pool, s)
    tokens = list(range(BS))
    pool.commit(s, [a], tokens)
    pool.handoff(s, "r", [a], BS)
    got = pool.claim(t, "r")
    assert got.block_ids == [a]
    pool.free(t, [a])  # now cached, generation kept
    hit = pool.lookup(s, tokens)
    assert hit.block_ids == [a]
    pool.free(s, hit.block_ids)
    evicting = pool.alloc(s, 2)  # takes the free block and evicts the cached one
    assert block_of(a) in [block_of(b) for b in evicting] and a not in evicting
    assert pool.lookup(t, tokens).block_ids == []
    with pytest.raises(StaleBlock):
        pool.free(t, [a])
    assert balanced(pool)


def test_a_worker_that_resumes_after_its_lease_expired_is_refused():
    """A worker paused past its lease: its session is gone and its blocks went to another worker. Neither its old
    session nor a new one can act on its old ids, and the new owner's blocks are untouched."""
    clock = Clock()
    pool = make_pool(clock, n=2)
    paused = pool.open_session("paused", "decode").session_id
    ids = pool.alloc(paused, 2)
    pool.commit(paused, ids[:1], list(range(BS)))
    clock.now += 3.0  # past the 2 s lease, without a heartbeat
    other = pool.open_session("other", "prefill").session_id
    assert pool.expire() == (1, 0)
    taken = pool.alloc(other, 2)
    assert sorted(map(block_of, taken)) == sorted(map(block_of, ids))
    with pytest.raises(UnknownSession, match="expired"):
        pool.free(paused, ids)
    resumed = pool.open_session("paused", "decode").session_id  # it reconnects and goes on with its old ids
    before = snapshot(pool)
    for call in (lambda: pool.free(resumed, ids), lambda: pool.commit(resumed, ids, list(range(2 * BS))),
                 lambda: pool.handoff(resumed, "late", ids, 1)):  # fmt: skip
        with pytest.raises(StaleBlock) as refused:
            call()
        assert set(refused.value.stale) == set(ids)
    assert snapshot(pool) == before
    assert pool.allocator.held(f"s:{other}") == {block_of(b): 1 for b in taken}
    assert pool.free(other, taken) == 2 and balanced(pool)
