"""The pool's side of slabs and the slab table: grants and returns in the books, what the pool does with what a
session wrote into its region when it settles handoffs, when a session dies, and when the pool needs room."""

from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidRequest, NotOwner, PoolExhausted, StaleBlock
from kvpool.ids import BLOCK_MASK, GEN_MASK, GEN_STEP, block_of, fence
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.books.slabs import SlabBooks
from kvpool.slab.table import ALLOCATED, ENTRY, ENTRY_HEAD, HANDED, IDLE, RING


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def books(tmp_path: Path, clock: Clock) -> Iterator[SlabBooks]:
    pool = Pool(32, KVLayout(block_size=4), lease_ttl_s=2.0, clock=clock)
    books = pool.open_slabs(tmp_path, regions=4, slots=16, box_dir=tmp_path)
    yield books
    books.close()


def balanced(pool: Pool) -> None:
    s = pool.stats()
    assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
    pool.allocator.check()


def place(books: SlabBooks, sid: str, ids: list[int], state: int) -> list[int]:
    """Write granted ids into the session's region as its client does; the slots they took."""
    slots = books.table[books.occupants[sid].region]["slots"]
    used = np.flatnonzero(slots["state"] != 0)
    free = [i for i in range(books.slots) if i not in set(used.tolist())][: len(ids)]
    slots["block"][free] = ids
    slots["state"][free] = state
    return free


def hand(books: SlabBooks, producer: str, consumer: str, slots: list[int], seq: int) -> None:
    """Mark slots handed as a producer's client does: the other fields first, the state last."""
    p, c = books.occupants[producer], books.occupants[consumer]
    region = books.table[p.region]
    region["slots"]["to_region"][slots] = c.region
    region["slots"]["to_nonce"][slots] = c.nonce
    region["slots"]["seq"][slots] = seq
    region["slots"]["state"][slots] = HANDED
    region["hseq"] = seq


def take(books: SlabBooks, consumer: str, producer: str, seq: int) -> None:
    """What a consumer's client writes once it took the producer's handoff ``seq``: took, then watch."""
    p, c = books.occupants[producer], books.occupants[consumer]
    region = books.table[c.region]
    region["took"][p.region] = seq
    region["watch"][p.region] = p.nonce


def session(books: SlabBooks, name: str) -> str:
    sid = books.pool.open_session(name, "other").session_id
    books.open(sid)
    return sid


def test_a_slab_is_the_sessions_blocks_and_goes_back_in_bulk(books: SlabBooks) -> None:
    pool = books.pool
    sid = session(books, "a")
    ids = books.grant(sid, 10, [])
    assert len(ids) == 10 and pool.stats()["in_use"] == 10
    balanced(pool)
    books.grant(sid, 0, ids[:6])
    assert pool.stats()["in_use"] == 4 and pool.stats()["free"] == 28
    balanced(pool)
    with pytest.raises(StaleBlock):  # given back, its generation moved: the old id names nothing
        books.grant(sid, 0, ids[:1])
    assert len(books.grant(sid, 100, [])) == 12  # at most `slots` blocks, the 4 still held included
    balanced(pool)


def test_give_refuses_blocks_outside_the_slab_and_changes_nothing(books: SlabBooks) -> None:
    pool = books.pool
    sid = session(books, "a")
    slab = books.grant(sid, 4, [])
    plain = pool.alloc(sid, 2)
    before = pool.stats()
    with pytest.raises(NotOwner):
        books.grant(sid, 3, [slab[0], plain[0]])
    after = pool.stats()
    assert (after["free"], after["in_use"]) == (before["free"], before["in_use"])
    assert books.occupants[sid].slab == {i & BLOCK_MASK for i in slab}


def test_settle_moves_handed_blocks_to_their_consumer_once_it_took_them(books: SlabBooks) -> None:
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 6, [])
    slots = place(books, p, ids, ALLOCATED)
    hand(books, p, c, slots[:3], seq=1)
    assert books.settle(books.occupants[p].region) == 3
    region = books.table[books.occupants[p].region]
    assert region["settled"][slots[:3]].tolist() == [1, 1, 1]  # the producer may reuse those slots
    assert books.stats()["slab_in_flight"] == 3 and pool.counters.handoffs == 1
    with pytest.raises(NotOwner):
        pool.free(p, ids[:3])  # no longer the producer's
    with pytest.raises(NotOwner):
        pool.free(c, ids[:3])  # nor the consumer's until it took them: it may not know of them yet
    take(books, c, p, 1)
    assert books.settle(books.occupants[p].region) == 0  # settled once only; what is in flight moves on
    assert (pool.counters.handoffs, pool.counters.claims) == (1, 1)  # one handoff of three blocks, as /claim counts
    pool.free(c, ids[:3])  # the consumer holds them now
    assert books.stats()["slab_in_flight"] == 0
    balanced(pool)


def _dead_producer(books: SlabBooks, clock: Clock) -> tuple[str, str, list[int], list[int], int]:
    """A producer holding 8 slab blocks (5 allocated) that hands two to a consumer under sequence 7; (producer,
    consumer, ids, slots, producer region)."""
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 8, [])
    slots = place(books, p, ids, IDLE)
    books.table[books.occupants[p].region]["slots"]["state"][slots[:5]] = ALLOCATED
    hand(books, p, c, slots[:2], seq=7)
    return p, c, ids, slots, books.occupants[p].region


def _expire_producer(books: SlabBooks, clock: Clock, consumer: str) -> None:
    clock.now += 1.5
    books.pool.heartbeat(consumer)
    clock.now += 1.0  # the producer's lease ran out, the consumer's did not
    assert books.pool.expire() == (1, 0)


def test_a_dead_producers_handoff_its_consumer_took_is_the_consumers_and_the_rest_comes_back(
    books: SlabBooks, clock: Clock
) -> None:
    pool = books.pool
    p, c, ids, _, region = _dead_producer(books, clock)
    books.settle(region)  # the sweep: in flight
    take(books, c, p, 7)
    _expire_producer(books, clock, c)
    assert pool.stats()["in_use"] == 2  # the two handed blocks, now the consumer's
    pool.free(c, ids[:2])
    assert pool.stats()["in_use"] == 0
    assert int(books.table[region]["nonce"]) == 0 and p not in books.occupants  # the region is free and zeroed
    balanced(pool)


def test_a_dead_producers_datagram_waits_for_its_consumer_to_read_it_and_one_never_sent_comes_back(
    books: SlabBooks, clock: Clock
) -> None:
    """A handoff that went as a datagram is in the consumer's box: the pool keeps it in flight until the consumer
    reads it and names it (its producer's region is gone by then). One still queued in the producer never left:
    freed, or the consumer would hold blocks it can never learn of."""
    pool = books.pool
    p, c, ids, slots, region = _dead_producer(books, clock)
    p_nonce = books.occupants[p].nonce
    hand(books, p, c, slots[2:3], seq=8)
    books.table[region]["sent"][books.occupants[c].region] = 7  # 7 left as a datagram, 8 waits in the producer
    _expire_producer(books, clock, c)
    assert pool.stats()["in_use"] == 2 and books.stats()["slab_in_flight"] == 2
    with pytest.raises(NotOwner):
        pool.free(c, ids[:2])
    assert not books.holds(c, ids[:1], (region, p_nonce, 7))  # not the blocks of that handoff: nothing moves
    assert not books.holds(c, ids[:2], (region, p_nonce, 6))
    assert books.holds(c, ids[:2], (region, p_nonce, 7))  # what the consumer's claim asks once it read it
    pool.free(c, ids[:2])
    assert pool.stats()["in_use"] == 0 and books.stats()["slab_in_flight"] == 0
    balanced(pool)


def test_a_dead_producers_ring_handoff_is_parked_for_its_consumer(books: SlabBooks, clock: Clock) -> None:
    """Its ring goes with its region: what the consumer had not taken from it is parked in the pool for that
    consumer, under the entry's request id, where its claim finds it."""
    pool = books.pool
    _, c, ids, slots, region = _dead_producer(books, clock)
    c_occ = books.occupants[c]
    rid, meta = b"req-ring", b'{"first":1}'
    raw = ENTRY_HEAD.pack(7, 0, 0, c_occ.nonce, 5, c_occ.region, 2, slots[0], len(rid), len(meta))
    raw += array("q", ids[:2]).tobytes() + rid + meta
    at = 7 % RING * ENTRY
    books.table[region]["ring"][at : at + len(raw)] = np.frombuffer(raw, np.uint8)
    _expire_producer(books, clock, c)
    handoff = pool.claim(c, "req-ring")
    assert (handoff.block_ids, handoff.num_tokens, handoff.meta) == (ids[:2], 5, {"first": 1})
    assert books.counters.handed_parked == 2
    pool.free(c, ids[:2])
    assert pool.stats()["in_use"] == 0
    balanced(pool)


def test_a_dead_producers_ring_entry_that_names_other_blocks_is_freed(books: SlabBooks, clock: Clock) -> None:
    pool = books.pool
    _, c, ids, slots, region = _dead_producer(books, clock)
    c_occ = books.occupants[c]
    raw = ENTRY_HEAD.pack(7, 0, 0, c_occ.nonce, 5, c_occ.region, 2, slots[0], 3, 0)
    raw += array("q", [ids[0], ids[3]]).tobytes() + b"lie"
    at = 7 % RING * ENTRY
    books.table[region]["ring"][at : at + len(raw)] = np.frombuffer(raw, np.uint8)
    _expire_producer(books, clock, c)
    assert not pool.handoffs and pool.stats()["in_use"] == 0
    balanced(pool)


def test_blocks_handed_to_a_consumer_that_ended_come_back(books: SlabBooks) -> None:
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 4, [])
    slots = place(books, p, ids, ALLOCATED)
    hand(books, p, c, slots[:3], seq=1)
    pool.close_session(c)
    assert books.settle_all() == 3
    assert pool.stats()["in_use"] == 1 and books.counters.handed_released == 3
    assert (pool.counters.handoffs, pool.counters.claims) == (1, 0)
    balanced(pool)


def test_settle_ignores_what_a_region_says_about_blocks_outside_its_slab(books: SlabBooks) -> None:
    """A session can write anything into its region: the pool acts only on blocks its books put in that slab."""
    pool = books.pool
    p, c, victim = session(books, "p"), session(books, "c"), session(books, "victim")
    theirs = pool.alloc(victim, 2)
    slots = place(books, p, theirs, ALLOCATED)
    hand(books, p, c, slots, seq=1)
    books.settle(books.occupants[p].region)
    assert books.counters.handed_ignored == 2
    pool.free(victim, theirs)  # still the victim's
    balanced(pool)


def test_a_full_pool_raises_the_want_flag_of_slabs_with_idle_blocks(books: SlabBooks) -> None:
    pool = books.pool
    a, b, idle_none = session(books, "a"), session(books, "b"), session(books, "c")
    ids = books.grant(a, 16, [])
    place(books, a, ids, IDLE)
    books.grant(idle_none, 4, [])  # nothing written to its region: no idle slot for the pool to see
    pool.alloc(b, 12)
    with pytest.raises(PoolExhausted):
        pool.alloc(b, 1)
    assert int(books.table[books.occupants[a].region]["want"]) == 1
    assert int(books.table[books.occupants[idle_none].region]["want"]) == 0
    books.grant(a, 0, ids)  # what its client does at its next call
    pool.alloc(b, 1)
    balanced(pool)


def test_the_table_is_private_to_the_pools_user_and_goes_with_the_pool(books: SlabBooks) -> None:
    mode = stat.S_IMODE(os.stat(books.path).st_mode)
    assert mode == 0o600
    path = books.path
    books.close()
    assert not path.exists()


def test_a_producer_cannot_free_what_its_slab_handed(books: SlabBooks) -> None:
    """Its free settles its region first: the handed blocks are in flight by then, and the free is refused."""
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 2, [])
    slots = place(books, p, ids, ALLOCATED)
    hand(books, p, c, slots, seq=1)
    with pytest.raises(NotOwner):
        pool.free(p, ids)
    take(books, c, p, 1)
    books.settle_session(c)  # what the consumer's client asks before it names them
    books.settle(books.occupants[p].region)
    pool.free(c, ids)
    balanced(pool)


def test_a_handed_block_given_back_with_the_idle_ones_is_refused(books: SlabBooks) -> None:
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 3, [])
    slots = place(books, p, ids, IDLE)
    hand(books, p, c, slots[:1], seq=1)
    with pytest.raises(NotOwner):
        books.grant(p, 0, ids)
    books.grant(p, 0, ids[1:])
    take(books, c, p, 1)
    books.settle(books.occupants[p].region)
    pool.free(c, ids[:1])
    balanced(pool)


def test_a_refill_takes_what_the_arena_has_and_none_at_all_is_507(books: SlabBooks) -> None:
    pool = books.pool
    a, b = session(books, "a"), session(books, "b")
    pool.alloc(a, 20)
    assert len(books.grant(b, 16, [])) == 12
    with pytest.raises(PoolExhausted):
        books.grant(b, 1, [])
    balanced(pool)


def test_a_session_gets_no_pair_key_to_hand_off_to_itself(books: SlabBooks) -> None:
    """Its slab's refs would stay its own, so a handed id would still free before the claim: through the pool."""
    p, c = session(books, "p"), session(books, "c")
    with pytest.raises(InvalidRequest, match="itself"):
        books.pair_to(p, "p")
    assert books.pair_to(p, "c")[0] is books.occupants[c]


def test_the_pool_takes_in_a_slabs_new_generations_forward_only_and_for_its_own_blocks(books: SlabBooks) -> None:
    """A block freed into a slab gets its next generation in its slot; the pool refuses the old id from then on.
    What a session writes can move only its own blocks' generations, and only forward."""
    pool = books.pool
    p, victim = session(books, "p"), session(books, "victim")
    ids = books.grant(p, 3, [])
    slots = place(books, p, ids, ALLOCATED)
    theirs = pool.alloc(victim, 1)
    extra = place(books, p, theirs, ALLOCATED)  # another session's block, written into p's region
    region = books.table[books.occupants[p].region]["slots"]
    region["block"][slots[0]] = ids[0] + GEN_STEP  # freed into the slab and taken again
    region["block"][slots[1]] = fence(block_of(ids[1]), GEN_MASK)  # one generation back (31 bits wrap)
    region["block"][extra[0]] = theirs[0] + GEN_STEP
    with pytest.raises(StaleBlock):
        pool.free(p, ids[:1])
    assert pool.free(p, [ids[0] + GEN_STEP, ids[1]]) == 2
    assert pool.free(victim, theirs) == 1
    assert books.counters.generations_taken == 1
    balanced(pool)


def test_a_handoff_settled_in_two_parts_counts_once(books: SlabBooks) -> None:
    """The pool may settle while the producer is still marking a handoff's slots: the rest comes at the next
    settle, and the handoff and its claim count once."""
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 4, [])
    slots = place(books, p, ids, ALLOCATED)
    take(books, c, p, 2)  # a consumer that took both already (it read them before the pool settled)
    hand(books, p, c, slots[:2], seq=1)
    assert books.settle(books.occupants[p].region) == 2
    hand(books, p, c, slots[2:3], seq=1)
    assert books.settle(books.occupants[p].region) == 1
    hand(books, p, c, slots[3:], seq=2)
    assert books.settle(books.occupants[p].region) == 1
    assert (pool.counters.handoffs, pool.counters.claims) == (2, 2)
    pool.free(c, ids)
    balanced(pool)


def test_what_is_in_flight_to_a_consumer_that_ended_comes_back(books: SlabBooks) -> None:
    pool = books.pool
    p, c = session(books, "p"), session(books, "c")
    ids = books.grant(p, 3, [])
    slots = place(books, p, ids, ALLOCATED)
    hand(books, p, c, slots, seq=1)
    books.settle(books.occupants[p].region)
    assert books.stats()["slab_in_flight"] == 3
    pool.close_session(c)
    books.settle_all()  # the sweep
    assert pool.stats()["in_use"] == 0 and books.stats()["slab_in_flight"] == 0
    balanced(pool)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.sampled_from(["hand", "sweep", "take", "sent", "end p", "end c", "hold"]), max_size=12))
def test_no_live_session_ever_holds_a_handed_block_it_did_not_take(books: SlabBooks, steps: list[str]) -> None:
    """Whatever the order of handoffs, sweeps, takes, datagrams leaving and sessions ending: a block the producer
    handed is the consumer's only once it took it (or named it to the pool), and the books balance throughout."""
    pool = books.pool
    for sid in list(pool.sessions):
        pool.close_session(sid)
    p, c = session(books, "p"), session(books, "c")
    p_occ, c_occ = books.occupants[p], books.occupants[c]
    ids = books.grant(p, 6, [])
    slots = place(books, p, ids, ALLOCATED)
    seq, taken, named = 0, 0, set()
    for step in steps:
        live_p, live_c = p in pool.sessions, c in pool.sessions
        if step == "hand" and live_p and seq < 6:
            seq += 1
            handed = books.table[p_occ.region]["slots"]
            handed["to_region"][slots[seq - 1]], handed["to_nonce"][slots[seq - 1]] = c_occ.region, c_occ.nonce
            handed["seq"][slots[seq - 1]] = seq
            handed["state"][slots[seq - 1]] = HANDED
        elif step == "sweep":
            books.settle_all()
        elif step == "take" and live_c and live_p and taken < seq:
            taken += 1
            take(books, c, p, taken)
        elif step == "sent" and live_p:
            books.table[p_occ.region]["sent"][c_occ.region] = seq
        elif step == "end p" and live_p:
            pool.close_session(p)
        elif step == "end c" and live_c:
            pool.close_session(c)
        elif step == "hold" and live_c and not live_p and taken < seq:
            if books.holds(c, ids[taken : taken + 1], (p_occ.region, p_occ.nonce, taken + 1)):
                named.add(ids[taken])
            taken += 1
        balanced(pool)
        if c in pool.sessions:
            held = set(pool.allocator.refs_of(f"s:{c}"))
            knows = {ids[i] & BLOCK_MASK for i in range(taken)}
            assert held <= knows, f"the consumer holds {held - knows}, which it never took"
    for sid in list(pool.sessions):
        pool.close_session(sid)
    books.settle_all()
    assert pool.stats()["in_use"] == 0
    balanced(pool)
