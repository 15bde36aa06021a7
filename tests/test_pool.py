"""The pool's books: sessions and leases, handoffs and claims, expiry, stats."""

from __future__ import annotations

import pytest

from kvpool.errors import (
    HandoffExists,
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    LayoutMismatch,
    NotOwner,
    UnknownSession,
)
from kvpool.layout import KVLayout
from kvpool.server.pool import Pool


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


# -- handoffs addressed to one session ------------------------------------------------------------------------


def test_an_addressed_handoff_is_claimed_by_its_addressee_alone():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("prefill-0", "prefill").session_id
    d0 = pool.open_session("decode-0", "decode", inbox="/run/kvpool/inbox-0.sock").session_id
    d1 = pool.open_session("decode-1", "decode").session_id
    ids = pool.alloc(p, 2)
    pool.handoff(p, "for-d0", ids, 5, to="decode-0")
    pool.handoff(p, "for-anyone", pool.alloc(p, 1), 1)
    assert pool.handoffs["for-d0"].to == d0
    with pytest.raises(NotOwner, match="addressed to session 'decode-0'"):
        pool.claim(d1, "for-d0")
    assert pool.claim(d1).request_id == "for-anyone"  # the oldest it may claim, past the one addressed to d0
    with pytest.raises(HandoffNotFound):
        pool.claim(d1)
    assert pool.claim(d0).request_id == "for-d0"
    assert pool.allocator.held(f"s:{d0}") == dict.fromkeys(ids, 1) and balanced(pool)


def test_a_handoff_to_a_name_that_is_not_one_live_session_is_refused_and_remembered():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    pool.open_session("twin", "decode")
    pool.open_session("twin", "decode")
    ids = pool.alloc(p, 2)
    with pytest.raises(InvalidRequest, match="no live session is named 'ghost'"):
        pool.handoff(p, "r1", ids, 5, to="ghost")
    with pytest.raises(InvalidRequest, match="2 live sessions are named 'twin'"):
        pool.handoff(p, "r2", ids, 5, to="twin")
    assert not pool.handoffs and pool.allocator.held(f"s:{p}") == dict.fromkeys(ids, 1)
    # An addressee may hold ids its producer sent it directly: its claim says at once that they are not its.
    d = pool.open_session("d", "decode").session_id
    with pytest.raises(HandoffRefused, match=r"refused when its producer made it \(InvalidRequest: no live session"):
        pool.claim(d, "r1")
    # Its addressee was told and dropped the request: a later handoff of that id would be parked for nobody, so
    # it is refused and the producer keeps its blocks. An id whose refusal nobody saw yet is free again.
    with pytest.raises(HandoffRefused, match="hand it off under a new request id"):
        pool.handoff(p, "r1", ids, 5, to="d")
    assert pool.allocator.held(f"s:{p}") == dict.fromkeys(ids, 1)
    pool.handoff(p, "r2", ids, 5, to="d")
    assert pool.claim(d, "r2").block_ids == ids and "r2" not in pool.refused


def test_a_refused_handoff_never_shadows_one_parked_under_its_id():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    d = pool.open_session("d", "decode").session_id
    pool.handoff(p, "r", pool.alloc(p, 1), 1, to="d")
    with pytest.raises(HandoffExists):
        pool.handoff(p, "r", pool.alloc(p, 1), 1, to="d")
    pool.refuse("r", "a late refusal", p)
    assert "r" not in pool.refused and pool.claim(d, "r").request_id == "r"


def test_a_handoff_whose_addressee_ended_is_claimable_by_anyone():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    gone = pool.open_session("decode-0", "decode").session_id
    other = pool.open_session("decode-1", "decode").session_id
    ids = pool.alloc(p, 3)
    pool.handoff(p, "r", ids, 9, to="decode-0")
    pool.close_session(gone)
    assert pool.handoffs["r"].to is None
    assert pool.claim(other).block_ids == ids
    pool.handoff(other, "r2", ids, 9, to="decode-1")
    clock.now += 2.5  # decode-1's lease runs out: the handoff outlives it, now for anyone
    rescuer = pool.open_session("decode-2", "decode").session_id
    assert pool.claim(rescuer, "r2").block_ids == ids and balanced(pool)


def test_a_session_end_is_reported_with_its_inbox():
    ended = []
    pool = Pool(8, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), on_session_end=ended.append)
    a = pool.open_session("a", "decode", inbox="/tmp/inbox-a.sock").session_id
    pool.open_session("b", "decode", inbox="/tmp/inbox-b.sock")
    pool.close_session(a)
    pool.clock.now += 3  # type: ignore[attr-defined]
    pool.expire()
    assert [s.inbox for s in ended] == ["/tmp/inbox-a.sock", "/tmp/inbox-b.sock"]


def test_an_addressed_handoff_is_held_while_its_addressee_lives_then_expires_as_any():
    """Its addressee may be reading ids its producer sent it: the blocks must not be freed under it."""
    clock = Clock()
    pool = make_pool(clock)  # handoffs live 5 s, leases 2 s
    p = pool.open_session("p", "prefill").session_id
    d = pool.open_session("d", "decode").session_id
    ids = pool.alloc(p, 2)
    pool.handoff(p, "held", ids, 5, to="d")
    pool.handoff(p, "loose", pool.alloc(p, 1), 1)
    for _ in range(6):  # 6 s: past the handoff's ttl, with d heartbeating
        clock.now += 1.0
        pool.heartbeat(d)
        pool.heartbeat(p)
        pool.expire()
    assert set(pool.handoffs) == {"held"}  # the unaddressed one expired; the addressed one waits for d
    for _ in range(3):  # d stops heartbeating: its lease ends, the handoff is anyone's, with 5 s to live
        clock.now += 1.0
        pool.heartbeat(p)
        pool.expire()
    assert pool.handoffs["held"].to is None and pool.handoffs["held"].expires_at == clock.now + 5.0
    for _ in range(6):
        clock.now += 1.0
        pool.heartbeat(p)
        pool.expire()
    assert not pool.handoffs and pool.stats()["in_use"] == 0 and balanced(pool)


def test_sessions_past_their_lease_are_not_live_even_before_the_sweep():
    clock = Clock()
    pool = make_pool(clock)
    pool.open_session("decode-0", "decode")
    clock.now += 2.5  # its lease ran out; no sweep has run
    fresh = pool.open_session("decode-0", "decode")
    assert [s.session_id for s in pool.live_sessions("decode-0")] == [fresh.session_id]
    assert pool.named("decode-0") is fresh


def test_a_claim_whose_claimer_left_is_parked_again_as_it_was():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    d = pool.open_session("d", "decode").session_id
    ids = pool.alloc(p, 2)
    pool.handoff(p, "r", ids, 5, meta={"t": 1}, to="d")
    taken = pool.claim(d, "r")
    assert pool.unclaim(d, taken)
    assert pool.allocator.held(f"s:{d}") == {} and balanced(pool)
    with pytest.raises(NotOwner):
        pool.claim(p, "r")  # still addressed to d alone
    again = pool.claim(d)
    assert (again.request_id, again.block_ids, again.meta) == ("r", ids, {"t": 1})
    pool.free(d, ids)
    assert not pool.unclaim(d, again)  # its blocks are gone: nothing to park again
    assert pool.stats()["in_use"] == 0 and balanced(pool)


def test_sweeps_expire_by_deadline_and_renewed_leases_survive_them():
    clock = Clock()
    pool = make_pool(clock)
    live = pool.open_session("live", "other").session_id
    idle = [pool.open_session(f"idle-{i}", "other").session_id for i in range(3)]
    pool.handoff(idle[0], "anyones", pool.alloc(idle[0], 1), 1, ttl_s=3.0)
    pool.handoff(idle[1], "for-live", pool.alloc(idle[1], 1), 1, to="live")
    clock.now += 1.5
    pool.heartbeat(live)
    clock.now += 1.0  # idle leases (2 s) ran out; live's was renewed
    assert pool.expire() == (3, 0)
    assert set(pool.sessions) == {live}
    clock.now += 1.0  # the unaddressed handoff's 3 s ran out; the addressed one never expires while live lives
    pool.heartbeat(live)
    assert pool.expire() == (0, 1)
    assert set(pool.handoffs) == {"for-live"}
    assert pool.claim(live).request_id == "for-live" and balanced(pool)


def test_a_session_is_told_the_blocks_it_holds_once_per_ref_and_asking_is_no_heartbeat():
    clock = Clock()
    pool = make_pool(clock)
    a = pool.open_session("a", "other").session_id
    b = pool.open_session("b", "other").session_id
    ids = pool.alloc(a, 2)
    pool.commit(a, ids[:1], [1, 2, 3, 4])
    pool.lookup(a, [1, 2, 3, 4])  # a second ref on the committed block
    assert sorted(pool.held(a)) == sorted([ids[0], ids[0], ids[1]]) and pool.held(b) == []
    pool.free(a, ids[1:])
    assert sorted(pool.held(a)) == [ids[0], ids[0]]
    clock.now += 1.5
    pool.held(a)  # not a heartbeat: its lease runs out as it would have
    clock.now += 1.0
    with pytest.raises(UnknownSession):
        pool.held(a)
