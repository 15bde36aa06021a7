"""The pool's books: sessions and leases, handoffs and claims, expiry, stats."""

from __future__ import annotations

import pytest

from kvpool.errors import HandoffExists, HandoffNotFound, InvalidRequest, LayoutMismatch, NotOwner, UnknownSession
from kvpool.layout import KVLayout
from kvpool.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(clock: Clock, n: int = 8) -> Pool:
    return Pool(n, KVLayout(block_size=4), lease_ttl_s=2.0, handoff_ttl_s=5.0, clock=clock)


def balanced(pool: Pool) -> bool:
    s = pool.stats()
    return s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]


def test_handoff_moves_refs_and_claim_takes_them():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("prefill-0", "prefill").session_id
    d = pool.open_session("decode-0", "decode").session_id
    ids = pool.alloc(p, 3)
    pool.handoff(p, "req-1", ids, 10, {"first_token": 5})
    with pytest.raises(NotOwner):
        pool.free(p, ids)  # the prefill's refs moved to the handoff
    with pytest.raises(HandoffExists):
        pool.handoff(p, "req-1", [], 0)
    got = pool.claim(d)  # the oldest parked handoff
    assert (got.request_id, got.block_ids, got.num_tokens, got.meta) == ("req-1", ids, 10, {"first_token": 5})
    with pytest.raises(HandoffNotFound):
        pool.claim(d, "req-1")
    assert pool.free(d, ids) == 3
    assert pool.stats()["free"] == 8 and balanced(pool)


def test_handoff_checks_token_count_and_ownership_first():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    ids = pool.alloc(p, 2)
    with pytest.raises(InvalidRequest, match="does not fit"):
        pool.handoff(p, "r", ids, 9)
    with pytest.raises(NotOwner):
        pool.handoff(p, "r", [*ids, 5], 4)
    assert not pool.handoffs and pool.allocator.held(f"s:{p}") == {0: 1, 1: 1}


def test_expired_session_releases_everything_and_is_refused_after():
    clock = Clock()
    pool = make_pool(clock)
    dead = pool.open_session("crashes", "prefill").session_id
    live = pool.open_session("lives", "decode").session_id
    pool.alloc(dead, 3)
    kept = pool.alloc(live, 2)
    clock.now += 1.5
    pool.heartbeat(live)
    clock.now += 1.0
    assert pool.expire() == (1, 0)
    assert pool.stats()["in_use"] == 2 and balanced(pool)
    with pytest.raises(UnknownSession, match="expired"):
        pool.alloc(dead, 1)
    assert pool.free(live, kept) == 2


def test_unclaimed_handoff_is_released_after_its_ttl():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    pool.handoff(p, "lost", pool.alloc(p, 2), 8, ttl_s=1.0)
    clock.now += 0.5
    pool.heartbeat(p)
    assert pool.expire() == (0, 0)
    clock.now += 0.6
    assert pool.expire() == (0, 1)
    assert pool.stats()["in_use"] == 0 and pool.counters.blocks_reclaimed == 2


def test_session_of_another_epoch_is_told_the_pool_restarted():
    pool = make_pool(Clock())
    with pytest.raises(UnknownSession, match="restarted"):
        pool.alloc("0000dead-abc", 1)


def test_layout_mismatch_names_the_fields():
    pool = make_pool(Clock())
    with pytest.raises(LayoutMismatch, match=r"head_dim: pool 64 != yours 128.*dtype"):
        pool.open_session("w", "decode", KVLayout(block_size=4, head_dim=128, dtype="bf16"))
    assert pool.open_session("w", "decode", KVLayout(block_size=4)).name == "w"


def test_stats_report_hits_and_counters():
    pool = make_pool(Clock())
    s = pool.open_session("s", "prefill").session_id
    ids = pool.alloc(s, 2)
    pool.commit(s, ids, list(range(8)))
    pool.lookup(s, list(range(12)))
    st = pool.stats()
    assert st["hit_rate"] == pytest.approx(2 / 3)
    assert st["counters"]["committed_blocks"] == 2 and st["indexed"] == 2
