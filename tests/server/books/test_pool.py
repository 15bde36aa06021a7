"""The pool's books: sessions and leases, handoffs and claims, expiry, stats."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import (
    HandoffExists,
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    LayoutMismatch,
    LimitExceeded,
    NameTaken,
    NotOwner,
    PoolExhausted,
    UnknownSession,
)
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.books.processes import Peer
from kvpool.server.books.records import NAMES_KEPT, Limits


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


def test_a_sealed_handoff_is_taken_only_by_a_claim_that_names_it_and_says_who_parked_it():
    """Issue 46, findings 1 and 2: a resident prefill's park was anyone's to take with a claim of the oldest, and its
    claimer could not tell whether the engine it expected had parked it."""
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("prefill-0", "prefill").session_id
    d = pool.open_session("decode-0", "decode").session_id
    ids = pool.alloc(p, 2)
    pool.handoff(p, "unguessable", ids, 8, sealed=True)
    with pytest.raises(HandoffNotFound):
        pool.claim(d)  # the oldest claimable: a sealed handoff is not among them
    got = pool.claim(d, "unguessable")
    assert got.block_ids == ids and got.parked_by == "prefill-0"
    pool.handoff(p, "expires", pool.alloc(p, 1), 4, ttl_s=1.0, sealed=True)
    clock.now += 1.5
    assert pool.expire() == (0, 1), "a sealed handoff nobody claims is released after its TTL"
    assert pool.free(d, ids) == 2 and balanced(pool)


def test_a_sealed_handoff_addressed_to_a_session_is_not_its_oldest():
    """A sealed handoff with ``to`` was still taken by its addressee's claim of the oldest: the seal must hold for
    it as for one addressed to nobody, and it is refused with its addressee as any addressed handoff."""
    pool = make_pool(Clock())
    p = pool.open_session("prefill-0", "prefill").session_id
    d = pool.open_session("decode-0", "decode").session_id
    mine = pool.alloc(p, 1)
    pool.handoff(p, "secret", mine, 4, to="decode-0", sealed=True)
    with pytest.raises(HandoffNotFound):
        pool.claim(d)
    assert pool.claim(d, "secret").block_ids == mine
    pool.handoff(p, "orphan", pool.alloc(p, 1), 4, to="decode-0", sealed=True)
    pool.close_session(d)
    with pytest.raises(HandoffRefused):
        pool.claim(p, "orphan")
    assert balanced(pool) and pool.stats()["handoffs"] == 0


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


def test_a_handoff_whose_addressee_ended_reaches_no_other_session():
    """Addressed to the session that held the name when it was parked: once that session ends, nobody gets it, not
    one that takes the name next (its worker restarted, or a stranger), not a claim of the oldest. It is refused,
    its blocks come back at once, and a claim of it says why: so its producer can learn it too."""
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    gone = pool.open_session("decode-0", "decode").session_id
    ids = pool.alloc(p, 3)
    pool.handoff(p, "r", ids, 9, to="decode-0")
    pool.close_session(gone)
    again = pool.open_session("decode-0", "decode").session_id
    other = pool.open_session("decode-1", "decode").session_id
    with pytest.raises(HandoffNotFound):
        pool.claim(again)
    assert not pool.handoffs and pool.stats()["in_use"] == 0 and balanced(pool)
    assert pool.counters.handoffs_orphaned == 1 and pool.counters.blocks_reclaimed == 3
    # The producer asks (a claim of a request addressed to someone else takes nothing): refused, and why.
    with pytest.raises(HandoffRefused, match=r"'r'.*addressee, session 'decode-0', ended before it claimed it"):
        pool.claim(p, "r")
    with pytest.raises(HandoffRefused, match="ended before it claimed it"):
        pool.claim(other, "r")
    # Its claimer was told, so the request id is spent; the blocks go to the new decode-0 under a new one.
    ids = pool.alloc(p, 3)
    with pytest.raises(HandoffRefused, match="hand it off under a new request id"):
        pool.handoff(p, "r", ids, 9, to="decode-0")
    pool.handoff(p, "r-again", ids, 9, to="decode-0")
    assert pool.claim(again).block_ids == ids and balanced(pool)


def test_a_handoff_is_bound_to_the_session_that_held_the_name_when_it_was_parked():
    """A consumer whose lease ran out and a new session under its name, before any sweep: what was addressed to the
    first is refused (the claim that finds its lease gone ends it), what comes after goes to the second."""
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    pool.open_session("decode-0", "decode")
    old = pool.alloc(p, 2)
    pool.handoff(p, "old", old, 5, to="decode-0")
    clock.now += 1.5
    pool.heartbeat(p)
    clock.now += 1.0  # decode-0's lease ran out; no sweep has run
    fresh = pool.open_session("decode-0", "decode").session_id
    new = pool.alloc(p, 1)
    pool.handoff(p, "new", new, 1, to="decode-0")
    assert pool.handoffs["new"].to == fresh
    with pytest.raises(HandoffRefused, match="ended before it claimed it"):
        pool.claim(fresh, "old")
    assert pool.claim(fresh).request_id == "new"
    with pytest.raises(HandoffNotFound):
        pool.claim(fresh)
    assert pool.allocator.held(f"s:{fresh}") == dict.fromkeys(new, 1) and pool.stats()["in_use"] == 1
    assert balanced(pool)


KEY = "decode-0's secret key"


def test_a_name_opened_with_a_key_opens_again_only_with_that_key():
    """A restarted worker takes its name back with its key; while it is down nobody else can take the name, so
    nobody else receives what its producers address to it. A refused open changes nothing."""
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    d = pool.open_session("decode-0", "decode", name_key=KEY).session_id
    pool.close_session(d)
    before = (dict(pool.sessions), pool.counters.sessions_opened)
    with pytest.raises(NameTaken, match=r"'decode-0' is held under a name key, and this session gave none"):
        pool.open_session("decode-0", "decode")
    with pytest.raises(NameTaken, match="gave another"):
        pool.open_session("decode-0", "decode", name_key="somebody else's key")
    assert (dict(pool.sessions), pool.counters.sessions_opened) == before
    with pytest.raises(InvalidRequest, match="no live session is named 'decode-0'"):
        pool.handoff(p, "while-down", pool.alloc(p, 1), 1, to="decode-0")  # the producer learns it at once
    back = pool.open_session("decode-0", "decode", name_key=KEY).session_id
    ids = pool.alloc(p, 2)
    pool.handoff(p, "r", ids, 5, to="decode-0")
    assert pool.claim(back, "r").block_ids == ids


def test_a_key_held_name_beside_a_session_without_it_addresses_nobody():
    """A name some session holds without a key (a stranger who came first, or the worker before it had one): a
    worker with a key still opens it, and the name then has two live sessions, so handoffs to it are refused (its
    producer learns it) until the other one ends; from then on only the key opens it."""
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    first = pool.open_session("decode-0", "decode").session_id
    keyed = pool.open_session("decode-0", "decode", name_key=KEY).session_id
    ids = pool.alloc(p, 1)
    with pytest.raises(InvalidRequest, match="2 live sessions are named 'decode-0'"):
        pool.handoff(p, "r", ids, 1, to="decode-0")
    pool.close_session(first)
    with pytest.raises(NameTaken):
        pool.open_session("decode-0", "decode")
    pool.handoff(p, "r2", ids, 1, to="decode-0")
    assert pool.claim(keyed).request_id == "r2"


def test_the_pool_forgets_the_oldest_keyed_names_nobody_holds_past_its_bound():
    pool = Pool(4, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), limits=Limits(max_sessions=NAMES_KEPT + 8))
    live = pool.open_session("live", "decode", name_key=KEY)
    for i in range(NAMES_KEPT - 1):
        pool.close_session(pool.open_session(f"w{i}", "other", name_key=KEY).session_id)
    assert len(pool.names.keys) == NAMES_KEPT
    pool.open_session("one-more", "other", name_key=KEY)  # "live" is older, but held
    assert len(pool.names.keys) == NAMES_KEPT and "w0" not in pool.names.keys and "live" in pool.names.keys
    assert pool.open_session("w0", "other").name == "w0"  # forgotten: anyone may open it again
    with pytest.raises(NameTaken):
        pool.open_session("w1", "other")
    assert pool.named("live") is live


NAMES = ("decode-0", "decode-1")
KEYS = (None, "the first worker's key", "the second worker's key")
consumer_ops = st.lists(
    st.tuples(
        st.sampled_from(["open", "close", "lapse", "handoff", "claim", "claim_any", "sweep"]),
        st.integers(0, 7),
        st.integers(0, 7),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(consumer_ops)
def test_a_handoff_reaches_only_the_session_its_name_resolved_to_when_parked(steps):
    """Consumers open (with a key or not), close, lapse and restart under two names while a producer addresses
    handoffs to the names and consumers claim: every claim returns a handoff to the session its name resolved to
    when it was parked, a keyed name opens only with its key, the books balance, and nothing outlives the sessions."""
    clock = Clock()
    pool = Pool(16, KVLayout(block_size=4), lease_ttl_s=2.0, handoff_ttl_s=5.0, clock=clock)
    producer = pool.open_session("p", "prefill").session_id
    consumers: list[str] = []
    bound: dict[str, str] = {}  # request id -> the session it was addressed to when it was parked
    keyed: dict[str, str] = {}  # name -> the key it was first opened with
    for n, (op, a, b) in enumerate(steps):
        pool.heartbeat(producer)
        name = NAMES[a % 2]
        if op == "open":
            key, opened = KEYS[b % 3], len(pool.sessions)
            try:
                consumers.append(pool.open_session(name, "decode", name_key=key).session_id)
            except NameTaken:
                assert name in keyed and key != keyed[name] and len(pool.sessions) == opened
            else:
                assert name not in keyed or key == keyed[name]
                if key is not None:
                    keyed.setdefault(name, key)
        elif op == "close" and consumers and pool._live(consumers[a % len(consumers)]) is not None:
            pool.close_session(consumers[a % len(consumers)])
        elif op == "lapse":
            clock.now += 1.5  # the consumers whose bit in b is set heartbeat meanwhile, the others may lapse
            for i, sid in enumerate(consumers):
                if (b >> (i % 3)) & 1 and pool._live(sid) is not None:
                    pool.heartbeat(sid)
        elif op == "handoff":
            try:
                ids = pool.alloc(producer, 1)
            except PoolExhausted:
                continue
            try:
                bound[f"r{n}"] = pool.handoff(producer, f"r{n}", ids, 1, to=name).to or ""
            except InvalidRequest:
                pool.free(producer, ids)
        elif op in ("claim", "claim_any") and consumers:
            sid = consumers[a % len(consumers)]
            if pool._live(sid) is None:
                continue
            rid = sorted(bound)[b % len(bound)] if op == "claim" and bound else None
            try:
                got = pool.claim(sid, rid)
            except (HandoffNotFound, HandoffRefused, NotOwner):
                continue
            assert bound[got.request_id] == sid
            pool.free(sid, got.block_ids)
        elif op == "sweep":
            pool.expire()
        assert balanced(pool)
        assert all(h.to in pool.sessions for h in pool.handoffs.values())
    clock.now += 3.0  # every lease runs out
    pool.expire()
    assert not pool.sessions and not pool.handoffs and pool.stats()["in_use"] == 0 and balanced(pool)


def test_a_session_end_is_reported_with_its_inbox():
    ended = []
    pool = Pool(8, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), on_session_end=ended.append)
    a = pool.open_session("a", "decode", inbox="/tmp/inbox-a.sock").session_id
    pool.open_session("b", "decode", inbox="/tmp/inbox-b.sock")
    pool.close_session(a)
    pool.clock.now += 3  # type: ignore[attr-defined]
    pool.expire()
    assert [s.inbox for s in ended] == ["/tmp/inbox-a.sock", "/tmp/inbox-b.sock"]


def test_an_addressed_handoff_is_held_while_its_addressee_lives_then_released_with_it():
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
    for _ in range(3):  # d stops heartbeating: its lease ends, and the handoff is refused with it
        clock.now += 1.0
        pool.heartbeat(p)
        pool.expire()
    assert not pool.handoffs and "held" in pool.refused and pool.stats()["in_use"] == 0 and balanced(pool)


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


def test_a_kv_packed_pool_keeps_each_arena_s_block_0_as_vllm_s_null_block():
    """vLLM writes padding into block 0 of its KV cache; in a kv_packed arena (a resident engine's cache) that is
    each arena's first block, which no session is ever given, however the pool is used or restarted."""
    pool = Pool([4, 4], KVLayout(block_size=4, order="kv_packed"))
    sid = pool.open_session("w", "other").session_id
    got = pool.alloc(sid, 3, arena=0) + pool.alloc(sid, 3, arena=1)
    assert sorted(got) == [1, 2, 3, 5, 6, 7]
    s = pool.stats()
    assert (s["free"], s["in_use"], s["cached"]) == (0, 8, 0) and balanced(pool)
    pool.close_session(sid)
    assert pool.stats()["in_use"] == 2 and balanced(pool)


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


def test_a_handoff_that_keeps_the_producer_s_refs_takes_its_own_on_committed_blocks_only():
    clock = Clock()
    pool = make_pool(clock)
    p = pool.open_session("p", "prefill").session_id
    d = pool.open_session("d", "decode").session_id
    ids = pool.alloc(p, 3)
    pool.commit(p, ids[:2], list(range(8)))
    with pytest.raises(InvalidRequest, match="committed blocks only"):
        pool.handoff(p, "r1", ids, 12, {}, keep=True)
    assert "r1" not in pool.handoffs and balanced(pool)  # refused: nothing changed
    pool.handoff(p, "r1", ids[:2], 8, {}, keep=True)
    assert sorted(pool.held(p)) == sorted(ids)  # the producer still holds all three
    claim = pool.claim(d, "r1")
    assert claim.block_ids == ids[:2]
    pool.free(p, ids)  # the producer lets go: the decode engine's refs keep the blocks in use
    assert pool.stats()["in_use"] == 2 and balanced(pool)
    pool.free(d, claim.block_ids)
    assert pool.stats()["in_use"] == 0 and pool.stats()["cached"] == 2 and balanced(pool)


def test_a_claim_says_which_session_parked_the_handoff():
    pool = make_pool(Clock())
    p = pool.open_session("prefill-0", "prefill").session_id
    q = pool.open_session("attacker", "other").session_id
    d = pool.open_session("decode-0", "decode").session_id
    pool.handoff(p, "r", pool.alloc(p, 1), 4, sealed=True)
    taken = pool.claim(q, "r")  # whoever knows the id takes it, and may park its own blocks under it again
    pool.free(q, taken.block_ids)
    pool.handoff(q, "r", pool.alloc(q, 1), 4, sealed=True)
    assert pool.claim(d, "r").parked_by == "attacker"  # which the consumer sees, and refuses


def test_a_paused_pool_expires_nobody_for_the_silence_it_did_not_hear():
    """A pool stopped longer than the lease (SIGSTOP, a frozen cgroup) wakes with its clients' heartbeats queued in
    its sockets: its first sweep must not expire them before it reads those."""
    clock = Clock()
    pool = Pool(8, KVLayout(block_size=4), lease_ttl_s=2.0, handoff_ttl_s=5.0, clock=clock, pause_slack_s=0.5)
    a, b = (pool.open_session(name, "other").session_id for name in ("a", "b"))
    ids = pool.alloc(a, 2)
    pool.handoff(a, "r", pool.alloc(a, 1), 4)
    for _ in range(3):  # running: the sweep reads the clock every quarter second, the clients beat every 0.6 s
        clock.now += 0.25
        pool.expire()
        clock.now += 0.35
        pool.heartbeat(a), pool.heartbeat(b)
    clock.now += 60.0  # stopped for a minute, past the lease and the handoff's time-out
    assert pool.expire() == (0, 0)
    pool.heartbeat(a), pool.heartbeat(b)  # what they sent meanwhile, read now
    assert pool.paused_s == pytest.approx(59.5)
    assert pool.held(a) == ids and pool.claim(b, "r").num_tokens == 4
    for _ in range(10):  # running again: a silent client's lease runs out as before, counted as the pool heard it
        clock.now += 0.25
        pool.heartbeat(a)
        pool.expire()
    assert pool.live_sessions() == [pool.sessions[a]] and pool.counters.sessions_expired == 1


ME, OTHER = Peer(None, 1000, 1000, None), Peer(None, 1001, 1001, None)  # two users' processes on the Unix socket


def test_one_peer_cannot_take_the_pool_s_handoff_or_session_budget_from_the_others():
    """Finding 6: kept handoffs cost no block, so a peer with one block and its own idle addressees could park the
    pool's whole --max-handoffs. Each peer gets a share of it, and of --max-sessions."""
    limits = Limits(max_sessions=16, max_sessions_per_peer=4, max_handoffs=64, max_handoffs_per_peer=16)
    pool = Pool(8, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), limits=limits)
    attacker = [pool.open_session(f"a{i}", "other", peer=OTHER).session_id for i in range(4)]
    with pytest.raises(LimitExceeded, match="max-sessions-per-peer"):
        pool.open_session("a4", "other", peer=OTHER)
    block = pool.alloc(attacker[0], 1)
    pool.commit(attacker[0], block, list(range(4)))
    for i in range(16):
        pool.handoff(attacker[0], f"k{i}", block, 4, to=f"a{1 + i % 3}", keep=True)
    with pytest.raises(LimitExceeded, match="max-handoffs-per-peer"):
        pool.handoff(attacker[0], "k16", block, 4, to="a1", keep=True)
    victim = pool.open_session("prefill-0", "prefill", peer=ME).session_id
    pool.open_session("decode-0", "decode", peer=Peer.tcp("loopback"))
    pool.handoff(victim, "r", pool.alloc(victim, 1), 4, to="decode-0")  # the others' share is still theirs
    assert pool.limits_exceeded == {"max_sessions_per_peer": 1, "max_handoffs_per_peer": 1}
    pool.close_session(attacker[1])  # its handoffs are refused with it, and their share comes back
    assert pool.parking.handoffs_of[OTHER.share] == 10 and pool._sessions_of[OTHER.share] == 3


def test_another_peer_s_keyed_opens_never_flush_a_name_s_key():
    """Finding 7: 4,096 keyed opens once made the pool forget a down worker's key, and the attacker took its name."""
    pool = Pool(4, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), limits=Limits(max_sessions=8))
    pool.close_session(pool.open_session("decode-0", "decode", name_key=KEY, peer=ME).session_id)
    for i in range(NAMES_KEPT + 8):  # the worker is down; an attacker keys name after name, as another user
        pool.close_session(pool.open_session(f"x{i}", "other", name_key="attacker's own key", peer=OTHER).session_id)
    with pytest.raises(NameTaken):
        pool.open_session("decode-0", "decode", name_key="attacker's own key", peer=OTHER)
    with pytest.raises(NameTaken, match="another peer"):  # a key seen in a log is not enough either
        pool.open_session("decode-0", "decode", name_key=KEY, peer=OTHER)
    assert pool.open_session("decode-0", "decode", name_key=KEY, peer=ME).name == "decode-0"
    assert len(pool.names.of[OTHER.share]) == NAMES_KEPT  # the attacker's own names are the ones forgotten


def test_a_name_pinned_by_the_operator_opens_only_for_its_user():
    pool = Pool(4, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), pins={"decode-0": 1000, "prefill-*": 1000})
    for name in ("decode-0", "prefill-3"):
        for peer in (OTHER, Peer.tcp("loopback"), None):  # a squatter first, keyed or not, over TCP, unknown
            with pytest.raises(NameTaken, match="pinned"):
                pool.open_session(name, "other", name_key="a squatter's key", peer=peer)
        assert pool.open_session(name, "other", name_key=KEY, peer=ME).name == name
    assert pool.open_session("decode-1", "other", peer=OTHER).name == "decode-1"  # not pinned


def test_the_pool_s_own_user_takes_no_share():
    """Its processes could stop the pool itself; and every container of the compose deployment runs as it."""
    limits = Limits(max_sessions=16, max_sessions_per_peer=2)
    pool = Pool(8, KVLayout(block_size=4), lease_ttl_s=2.0, clock=Clock(), limits=limits, own_uid=ME.uid)
    for i in range(4):
        pool.open_session(f"w{i}", "other", peer=ME)
    pool.open_session("o0", "other", peer=OTHER), pool.open_session("o1", "other", peer=OTHER)
    with pytest.raises(LimitExceeded, match="max-sessions-per-peer"):
        pool.open_session("o2", "other", peer=OTHER)
    assert pool._sessions_of == {OTHER.share: 2}
