"""Slabs as a client sees them, against a real pool started with ``--slabs``: alloc and free with no round trip,
refills and drains in bulk, handoffs from slab to slab (and the forged or replayed ones refused), the pool's flag
that drains a slab, and a killed session's slab and handed blocks coming back."""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.client import PoolClient
from kvpool.errors import (
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    NotOwner,
    PoolExhausted,
    StaleBlock,
    UnknownSession,
)
from kvpool.ids import GEN_STEP, block_of, generation_of
from kvpool.routes import COMMIT, FREE, Route
from kvpool.slab import SlabClient, SlabConfig, reservation, wire
from kvpool.slab.table import DONE, ENTRY, ENTRY_HEAD, HSEQ, RING, WAITING, WANT
from tests.conftest import ROOT, SMALL_POOL, LocalPool, PoolProcess, local_pool, start_pool

SMALL = SlabConfig(blocks=8, low=2, high=16)


SLAB_POOL = (*SMALL_POOL, "--slabs", "--slab-max-blocks", "48", "--lease-ttl-s", "1")


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    server = local_pool(*SLAB_POOL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def process() -> Iterator[PoolProcess]:
    """The same pool as a process, for the tests whose other client is a process of its own (killed, or lied to)."""
    server = start_pool(*SLAB_POOL)
    yield server
    server.stop()


def stats(pool: PoolProcess | LocalPool) -> dict[str, Any]:
    s = pool.stats()
    assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
    return s


def wait_idle(pool: PoolProcess | LocalPool, within_s: float = 10.0) -> dict[str, Any]:
    """The pool's books once every session of this test has ended (closed, or expired after its lease)."""
    deadline = time.monotonic() + within_s
    while (s := stats(pool))["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return s


def test_a_slab_config_comes_from_the_environment_and_bad_values_say_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_SLAB_BLOCKS", "64")
    assert SlabConfig.from_env() == SlabConfig(64, 8, 256, ring=True)
    monkeypatch.setenv("KVPOOL_SLAB_RING", "0")
    assert SlabConfig.from_env() == SlabConfig(64, 8, 256, ring=False)
    monkeypatch.setenv("KVPOOL_SLAB_RING", "no")
    with pytest.raises(InvalidRequest, match="_RING must be integers"):
        SlabConfig.from_env()
    monkeypatch.setenv("KVPOOL_SLAB_BLOCKS", "0")
    assert SlabConfig.from_env() is None


def test_alloc_and_free_come_from_the_slab_without_a_round_trip(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-a", slab=SMALL) as a:
        first = a.alloc(1)
        before = stats(pool)
        for _ in range(100):
            a.free(a.alloc(1))
        ids = a.alloc(3)
        after = stats(pool)
        assert after["counters"]["alloc_requests"] == before["counters"]["alloc_requests"]
        assert after["counters"]["free_requests"] == before["counters"]["free_requests"]
        assert after["slabs"]["counters"]["grants"] == before["slabs"]["counters"]["grants"]
        assert after["slabs"]["slab_allocated"] == 4 and after["in_use"] == before["in_use"]
        assert a.free([*ids, *first]) == 4
    assert wait_idle(pool)["in_use"] == 0


def test_a_slab_refills_and_drains_in_bulk(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-b", slab=SMALL) as b:
        held = [b.alloc(1)[0] for _ in range(20)]  # runs below `low` now and then: a refill of several blocks each
        s = stats(pool)["slabs"]["counters"]
        assert s["grants"] > 1 and s["blocks_granted"] >= 20
        grants = s["grants"]
        b.free(held)  # past `high`: back down to `blocks`, in one call
        s = stats(pool)
        assert s["slabs"]["counters"]["grants"] == grants + 1 and s["slabs"]["slab_idle"] == SMALL.blocks
    wait_idle(pool)


def test_a_refill_ahead_of_need_runs_off_the_caller_s_thread_while_allocs_and_frees_go_on(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-ahead", slab=SMALL) as b:
        slab = b.slab
        assert slab is not None
        held = [b.alloc(1)[0] for _ in range(SMALL.blocks - SMALL.low)]  # down to `low`: no refill under the lock yet
        grants = stats(pool)["slabs"]["counters"]["grants"]
        fetch, asked, answer = slab.transport.fetch, threading.Event(), threading.Event()

        def slow(*args: Any, **kwargs: Any) -> Any:  # the pool's answer waits until the test lets it through
            asked.set()
            answer.wait(10)
            return fetch(*args, **kwargs)

        slab.transport.fetch = slow  # type: ignore[method-assign]
        slab.refill_ahead()
        assert asked.wait(10), "the refill went to the pool"
        slab.refill_ahead()  # one is on its way: no second
        one = b.alloc(1)  # the slab's lock is free meanwhile
        b.free(one)
        answer.set()
        deadline = time.monotonic() + 10
        while slab.num_idle < SMALL.blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        slab.transport.fetch = fetch  # type: ignore[method-assign]
        assert slab.num_idle == SMALL.blocks
        assert stats(pool)["slabs"]["counters"]["grants"] == grants + 1, "one refill, not one per call"
        slab.refill_ahead()  # full: nothing to do
        b.free(held)
    assert wait_idle(pool)["in_use"] == 0


@pytest.mark.parametrize("n", [1, 2])
def test_a_free_of_the_pool_s_blocks_holds_no_lock_while_the_pool_answers(pool: LocalPool, n: int) -> None:
    """An engine releases its refs on the pool's blocks off its scheduler's thread; the scheduler's own frees into
    the slab, and its allocs, go on meanwhile rather than wait out that round trip."""
    with SlabClient(pool.url, name="slab-release", slab=SMALL) as b:
        committed = b.alloc(n)
        b.commit(committed, list(range(500, 500 + 4 * n)))  # the pool's now: a free of them is a round trip
        call, asked, answer = b.transport.call, threading.Event(), threading.Event()

        def slow(route: Route, *args: Any, **kwargs: Any) -> Any:  # the pool's answer waits until the test lets it
            if route is FREE:
                asked.set()
                answer.wait(10)
            return call(route, *args, **kwargs)

        b.transport.call = slow  # type: ignore[method-assign]
        release = threading.Thread(target=b.free, args=(committed,))
        release.start()
        try:
            assert asked.wait(10), "the release went to the pool"
            began = time.monotonic()
            mine = b.alloc(2)
            assert b.free(mine) == 2  # into the slab, while the release waits for the pool
            assert time.monotonic() - began < 5, "the slab's alloc and free waited for another thread's round trip"
        finally:
            answer.set()
            release.join(10)
            b.transport.call = call  # type: ignore[method-assign]
        assert stats(pool)["cached"] >= n
    assert wait_idle(pool)["in_use"] == 0


def test_a_full_pool_is_not_asked_ahead_of_need_again_every_step(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-ahead-full", slab=SMALL) as b:
        slab = b.slab
        assert slab is not None
        held = [b.alloc(1)[0] for _ in range(SMALL.blocks - SMALL.low)]
        fetch, calls = slab.transport.fetch, []

        def full(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[0].path)
            raise PoolExhausted("the arena is full")

        slab.transport.fetch = full  # type: ignore[method-assign]
        for _ in range(20):  # twenty scheduler steps, each waiting for the one before's refill to end
            slab.refill_ahead()
            deadline = time.monotonic() + 10
            while slab._topping and time.monotonic() < deadline:
                time.sleep(0.001)
        assert calls == ["/slabs/blocks"], "asked once, then left alone for a while"
        time.sleep(reservation.AHEAD_BACKOFF_S)
        slab.refill_ahead()
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(calls) == 2, "and asked again after it"
        slab.transport.fetch = fetch  # type: ignore[method-assign]
        b.free(held)
    assert wait_idle(pool)["in_use"] == 0


def test_a_slab_closed_while_a_refill_ahead_is_on_its_way_leaves_the_books_balanced(pool: LocalPool) -> None:
    b = SlabClient(pool.url, name="slab-ahead-close", slab=SMALL)
    slab = b.slab
    assert slab is not None
    for _ in range(SMALL.blocks - SMALL.low):
        b.alloc(1)
    fetch, asked = slab.transport.fetch, threading.Event()

    def late(*args: Any, **kwargs: Any) -> Any:
        asked.set()
        time.sleep(0.2)
        return fetch(*args, **kwargs)

    slab.transport.fetch = late  # type: ignore[method-assign]
    slab.refill_ahead()
    assert asked.wait(10)
    b.close()  # waits for the refill, which finds the slab closed and installs nothing
    assert wait_idle(pool)["in_use"] == 0


def test_a_double_or_stale_free_in_a_slab_is_refused_and_changes_nothing(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-c", slab=SMALL) as c:
        ids = c.alloc(2)
        with pytest.raises(NotOwner):
            c.free([ids[0], ids[0]])  # it holds one ref on each
        c.free(ids[:1])
        with pytest.raises(StaleBlock):
            c.free(ids)  # the first was freed already (into the slab: a new generation, as in the pool)
        assert stats(pool)["slabs"]["slab_allocated"] == 1
        c.slab._drain(0)  # type: ignore[union-attr]  # the idle one goes back to the pool
        with pytest.raises(StaleBlock):
            c.free(ids[:1])
        assert c.free(ids[1:]) == 1
        mine, plain = c.alloc(1), c.alloc(40)  # too many for the slab: through the pool
        c.free(plain)
        with pytest.raises(StaleBlock):
            c.free([*mine, plain[0]])  # the pool refuses its share: the slab's share stays allocated too
        assert stats(pool)["slabs"]["slab_allocated"] == 1
        assert c.free(mine) == 1
    wait_idle(pool)


def test_a_block_freed_into_the_slab_and_taken_again_has_a_new_id_that_the_pool_knows(pool: LocalPool) -> None:
    """An id kept past a free into the slab is refused in the slab and at the pool alike, whichever way it comes."""
    with SlabClient(pool.url, name="slab-gen", slab=SMALL) as c:
        old = c.alloc(1)
        c.free(old)
        new = c.alloc(1)
        assert block_of(new[0]) == block_of(old[0]) and generation_of(new[0]) == generation_of(old[0]) + 1
        with pytest.raises(StaleBlock):
            c.free(old)
        with pytest.raises(StaleBlock):
            c.commit(old, list(range(4)))
        r = c.transport.http.post("/free", json={"session_id": c.session_id, "block_ids": old})  # past the slab
        assert r.status_code == 409 and r.json()["stale_ids"] == old
        assert stats(pool)["slabs"]["slab_allocated"] == 1  # refused whole: still the slab's, allocated
        c.commit(new, list(range(4)))  # the pool took the new generation in: it accepts the new id
        assert c.free(new) == 1
    assert wait_idle(pool)["in_use"] == 0


def test_a_run_freed_into_the_slab_comes_back_as_the_same_run(pool: LocalPool) -> None:
    """Freed in the order they were allocated, a request's blocks go back so that the next alloc of as many is the
    same run of slots in the same order (a handoff of it is then checked as one run); the run's checks still refuse
    ids it does not hold, changing nothing."""
    with SlabClient(pool.url, name="slab-run", slab=SMALL) as c:
        ids = c.alloc(4)
        for _ in range(3):
            assert c.free(ids) == 4
            again = c.alloc(4)
            assert [block_of(i) for i in again] == [block_of(i) for i in ids]
            assert [generation_of(i) for i in again] == [generation_of(i) + 1 for i in ids]
            ids = again
        c.free(ids)
        idle = [i + GEN_STEP for i in ids]  # the slots' ids now: idle in the slab, not allocated
        with pytest.raises(NotOwner):
            c.free(idle)
        with pytest.raises(StaleBlock):
            c.free(ids)
        held = c.alloc(4)
        with pytest.raises(NotOwner):
            c.free([held[0], held[1], held[1]])  # not a run: each slot named once, or refused
        assert stats(pool)["slabs"]["slab_allocated"] == 4
        assert c.free(held) == 4
    assert wait_idle(pool)["in_use"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from(["asc", "desc", "shuffled", "part"])), min_size=1, max_size=14
    ),
    st.randoms(use_true_random=False),
)
def test_allocs_and_frees_in_any_order_keep_the_slabs_books(pool: LocalPool, steps: list[Any], rnd: Any) -> None:
    """Runs and scattered slots alike: every id held is a distinct block, a free gives back exactly what it names,
    and the pool's view of the slab counts what the client holds."""
    with SlabClient(pool.url, name="slab-any", slab=SMALL) as c:
        held: list[int] = []
        for n, order in steps:
            held += c.alloc(n)
            assert len({block_of(i) for i in held}) == len(held)
            if order == "part":
                give = held[: len(held) // 2]
            else:
                give = sorted(held) if order == "asc" else sorted(held, reverse=True)
                if order == "shuffled":
                    rnd.shuffle(give)
            assert c.free(give) == len(give)
            held = [i for i in held if i not in set(give)]
            assert stats(pool)["slabs"]["slab_allocated"] == len(held)
        c.free(held)
    assert wait_idle(pool)["in_use"] == 0


def test_committed_slab_blocks_leave_the_slab_and_are_cached(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-d", slab=SMALL) as d:
        ids = d.alloc(2)
        with pytest.raises(InvalidRequest):
            d.commit(ids[:1], list(range(8)))  # tokens for two blocks, one id: refused, and both stay in the slab
        assert stats(pool)["slabs"]["slab_allocated"] == 2
        d.commit(ids, list(range(8)))
        assert d.free(ids) == 2
        s = stats(pool)
        assert s["cached"] >= 2 and s["slabs"]["slab_allocated"] == 0
    wait_idle(pool)


def test_commits_sent_together_take_their_blocks_out_of_the_slab_one_by_one(pool: LocalPool) -> None:
    """A step's commits go in one write; the slab's blocks of each commit the pool took leave the slab, those of a
    commit it refused stay there (a free then puts them back into the slab, not through the pool)."""
    with SlabClient(pool.url, name="slab-m", slab=SMALL) as c:
        ids = c.alloc(5)
        first, second = list(range(7000, 7008)), list(range(7100, 7108))
        got = c.commit_many([(ids[:2], first, 0), (ids[2:3], second, 0), (ids[3:], [1], 0)])
        assert got[0] is not None and got[0].committed == 2 and got[2] is not None
        assert got[1] is None  # two blocks' tokens, one id: refused
        assert stats(pool)["slabs"]["slab_allocated"] == 1  # the refused commit's block stays in the slab
        assert c.free(ids) == 5
        s = stats(pool)
        assert s["cached"] >= 2 and s["slabs"]["slab_allocated"] == 0
    wait_idle(pool)


def test_a_large_alloc_of_blocks_the_slab_holds_idle_is_served_by_the_slab(pool: LocalPool) -> None:
    """An engine is told ``num_idle`` blocks may be taken; a refill ahead for a burst can hold more than half the slab,
    and an alloc of that many went to the pool, which may not have them (the engine's step then raised)."""
    with SlabClient(pool.url, name="slab-large", slab=SMALL) as c:
        region = c.slab
        assert region is not None
        n = region.capacity // 2 + 1
        region.ensure_idle(n + SMALL.low)
        before = region.num_idle
        assert before >= n + SMALL.low
        ids = c.alloc(n)
        assert region.num_idle == before - n, "the alloc went to the pool, not the slab's idle blocks"
        assert c.free(ids) == n
    wait_idle(pool)


def test_a_commit_s_round_trip_holds_no_lock_and_its_blocks_cannot_be_given_up_twice(pool: LocalPool) -> None:
    """An engine commits a step's finished prompts on a thread of its own, and its scheduler frees and allocates in
    the same step: those wait for no round trip (they waited out every commit). A block on its way to the pool is
    refused to any other call meanwhile, changing nothing, and leaves the slab once the pool took it."""
    with SlabClient(pool.url, name="slab-commit-lock", slab=SMALL) as c:
        ids = c.alloc(2)
        other = c.alloc(1)
        call_many, asked, answer = c.transport.call_many, threading.Event(), threading.Event()

        def slow(route: Route, *args: Any, **kwargs: Any) -> Any:  # the pool's answer waits for the test
            if route is COMMIT:
                asked.set()
                answer.wait(10)
            return call_many(route, *args, **kwargs)

        c.transport.call_many = slow  # type: ignore[method-assign]
        got: list[Any] = []
        commit = threading.Thread(target=lambda: got.extend(c.commit_many([(ids, list(range(900, 908)), 0)])))
        commit.start()
        try:
            assert asked.wait(10), "the commit went to the pool"
            began = time.monotonic()
            assert c.free(other) == 1  # into the slab, while the commit waits for the pool
            mine = c.alloc(2)
            assert c.free(mine) == 2
            assert time.monotonic() - began < 5, "the slab's alloc and free waited for another thread's round trip"
            before = stats(pool)["slabs"]["slab_allocated"]
            for give_up in (lambda: c.free(ids), lambda: c.free(ids[:1]), lambda: c.commit(ids, list(range(8)))):
                with pytest.raises(NotOwner, match="on its way"):
                    give_up()
            assert stats(pool)["slabs"]["slab_allocated"] == before, "a refused call changed nothing"
        finally:
            answer.set()
            commit.join(10)
            c.transport.call_many = call_many  # type: ignore[method-assign]
        assert got and got[0] is not None and got[0].committed == 2
        assert c.free(ids) == 2  # the pool's now: the slab let them go, and a free releases the session's refs
        s = stats(pool)
        assert s["cached"] >= 2 and s["slabs"]["slab_allocated"] == 0
    wait_idle(pool)


def test_a_slab_without_handoffs_allocates_locally_and_claims_through_the_pool(pool: LocalPool) -> None:
    config = SlabConfig(blocks=8, low=2, high=32, handoffs=False)
    with SlabClient(pool.url, name="slab-nh", slab=config) as c, PoolClient(pool.url, name="plain-p") as p:
        assert c.slab is not None and c.slab_box is None and c.slab_sender is None
        ids = c.alloc(2)
        assert stats(pool)["slabs"]["slab_allocated"] == 2  # from the slab, no round trip
        parked = [p.alloc(1) for _ in range(3)]
        p.handoff_many([(f"nh-{i}", b, 4, {}) for i, b in enumerate(parked)])
        got = c.claim_many([f"nh-{i}" for i in range(3)], timeout_s=2)  # pipelined in one write, not one by one
        assert [g.block_ids for g in got if g is not None] == parked
        c.free(ids + [i for g in got if g is not None for i in g.ids])
    assert wait_idle(pool)["in_use"] == 0


def test_a_kept_handoff_shares_committed_slab_blocks_and_the_producer_keeps_them(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-k", slab=SMALL) as p, PoolClient(pool.url, name="slab-c") as q:
        ids = p.alloc(2)
        p.commit(ids, list(range(7200, 7208)))
        (sent,) = p.handoff_many([("req-keep", ids, 8, {})], keep=True)
        assert sent is not None and not sent.slab
        got = q.claim("req-keep", timeout_s=5)
        assert got.block_ids == ids
        assert p.free(ids) == 2  # the producer's own refs, still its own
        assert stats(pool)["in_use"] >= 2  # the consumer's keep the blocks
        q.free(got.ids)
    assert wait_idle(pool)["in_use"] == 0


def test_a_handoff_from_slab_to_slab_reaches_the_consumer_and_the_refs_follow(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-p", slab=SMALL) as p, SlabClient(pool.url, name="slab-q", slab=SMALL) as q:
        ids = p.alloc(3)
        sent = p.handoff("req-slab-1", ids, 10, {"first_token": 7}, to="slab-q")
        assert sent.slab and sent.num_blocks == 3
        got = q.claim("req-slab-1", timeout_s=5)
        assert got.block_ids == ids and got.num_tokens == 10 and got.meta == {"first_token": 7} and got.direct
        with pytest.raises(NotOwner):
            p.free(ids)  # handed: no longer the producer's
        assert q.free(got.ids) == 3  # settled first, then freed through the pool
        assert stats(pool)["slabs"]["counters"]["handed_settled"] >= 3
    assert wait_idle(pool)["in_use"] == 0


def test_a_handoff_to_its_own_session_goes_through_the_pool(pool: LocalPool) -> None:
    """From a slab to itself the refs would never leave the session: until its claim, an id it handed would still
    free, and the block would be freed under the claim's feet. Parked in the pool, the refs are the handoff's."""
    with SlabClient(pool.url, name="slab-self", slab=SMALL) as a:
        ids = a.alloc(2)
        sent = a.handoff("req-self", ids, 1, to="slab-self")
        assert not sent.slab
        with pytest.raises(NotOwner):
            a.free(ids)  # handed: parked, not the session's until it claims them
        got = a.claim("req-self", timeout_s=5)
        assert got.block_ids == ids
        assert a.free(got.ids) == 2
    assert wait_idle(pool)["in_use"] == 0


def test_a_handoff_whose_datagram_cannot_leave_changes_nothing(pool: LocalPool) -> None:
    """The consumer's slab box is gone: the producer takes its slots back before the pool settles them, and the
    refusal says which blocks are still its own (all of them, unless the pool's sweep settled some in between)."""
    with SlabClient(pool.url, name="slab-s", slab=SMALL) as p, SlabClient(pool.url, name="slab-t", slab=SMALL) as q:
        p.handoff("req-warm", p.alloc(1), 1, to="slab-t")  # p knows the way to q's box now
        q.free(q.claim("req-warm", timeout_s=5).ids)
        assert q.slab_box is not None and q.slab_box.sock is not None and q.slab is not None
        q.slab_box.close()  # it reads no ring, its box is gone: p's socket, connected to it, is refused
        ids = p.alloc(3)
        with pytest.raises(HandoffRefused, match="could not reach") as refused:
            p.handoff("req-lost", ids, 4, to="slab-t")
        kept = list(refused.value.kept)  # type: ignore[attr-defined]
        assert set(kept) <= set(ids) and ("nothing was handed" in str(refused.value)) == (kept == ids)
        assert p.free(kept) == len(kept)  # the few the pool's sweep settled in between wait for q, which ends
        assert stats(pool)["slabs"]["slab_handed"] == 0
    assert wait_idle(pool)["in_use"] == 0


class Recorder:
    """Stands in for a producer's socket to one consumer, keeping what it sends."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.sent: list[bytes] = []
        self.hold = False  # keep what is sent from the consumer

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data) if self.hold else self.real.send(data)

    def close(self) -> None:
        self.real.close()


def recorded(producer: PoolClient, to: str) -> tuple[Recorder, str]:
    """What the producer sends to ``to`` from now on, and the path of ``to``'s slab box."""
    sender = producer.slab_sender
    assert sender is not None
    peer = sender._peer(to)
    assert peer is not None
    recorder = Recorder(peer.sock)
    peer.sock = recorder  # type: ignore[assignment]
    return recorder, peer.box


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "datagrams"])
def test_a_run_of_slots_goes_as_its_first_slot_and_other_ids_slot_by_slot(pool: LocalPool, ring: bool) -> None:
    """Allocs one after another hand out consecutive slots, so a request's blocks from several allocs are checked
    and sent as one run; ids in another order are checked and sent one by one. The consumer takes both on its
    producer's word (no round trip to the pool), from the producer's ring once it watches it, else from datagrams."""
    with SlabClient(pool.url, name="slab-r", slab=SMALL) as p, SlabClient(pool.url, name="slab-u", slab=SMALL) as q:
        assert p.slab is not None and q.slab_box is not None and p.slab_sender is not None
        p.slab_sender.use_ring = ring
        recorder, _ = recorded(p, "slab-u")
        first = p.alloc(1)
        p.handoff("req-pairing", first, 1, to="slab-u")  # the first to a consumer goes as a datagram either way
        assert q.claim("req-pairing", timeout_s=5).block_ids == first
        ids = p.alloc(2) + p.alloc(1) + p.alloc(1) + p.alloc(2)
        view, runs = p.slab.view, []
        for request_id, handed in (("req-run", ids[:4]), ("req-listed", [ids[5], ids[4]])):
            p.handoff(request_id, handed, 2, to="slab-u", meta={"n": len(handed)})
            entry = ENTRY_HEAD.unpack_from(view.rw, view.ring + view.words[HSEQ] % RING * ENTRY)
            if ring:
                runs.append(entry[7])
                assert entry[0] == view.words[HSEQ] and entry[5] == q.slab.info.region  # type: ignore[union-attr]
            got = q.claim(request_id, timeout_s=5)
            assert got.block_ids == handed and got.meta == {"n": len(handed)}
            assert p.slab.info.region in q.slab_box.to_settle
        sent = [wire.head(memoryview(d))[-1] for d in recorder.sent]  # type: ignore[index]
        assert len(sent) == (1 if ring else 3)
        runs = runs if ring else sent[1:]
        assert runs[0] >= 0 and runs[1] == -1
        assert q.free(first + ids[:4] + ids[4:][::-1]) == 7
    assert wait_idle(pool)["in_use"] == 0


def test_a_full_ring_falls_back_to_datagrams_and_every_handoff_arrives_in_order(pool: LocalPool) -> None:
    """A consumer that takes nothing for a while: the producer's ring fills (its entries are not overwritten before
    they are taken), the rest go as datagrams, and a claim takes them all, the ring's older ones before the
    datagrams that followed them (or the sequences would make the older ones look like replays)."""
    with SlabClient(pool.url, name="slab-k", slab=SMALL) as p, SlabClient(pool.url, name="slab-j", slab=SMALL) as q:
        recorder, _ = recorded(p, "slab-j")
        first = p.alloc(1)
        p.handoff("req-0", first, 1, to="slab-j")
        handed = {"req-0": first}
        assert q.claim("req-0", timeout_s=5).block_ids == first
        for i in range(1, RING + 5):
            handed[f"req-{i}"] = p.alloc(1)
            p.handoff(f"req-{i}", handed[f"req-{i}"], 1, to="slab-j")
        assert len(recorder.sent) == 1 + 4  # the pairing, then what the full ring could not hold
        got = {c.request_id: c.block_ids for c in (q.claim(None, timeout_s=5) for _ in range(RING + 4))}
        assert got == {r: ids for r, ids in handed.items() if r != "req-0"}
        with pytest.raises(HandoffNotFound):
            q.claim(None, timeout_s=0.1)
        assert q.free([i for ids in handed.values() for i in ids]) == RING + 5
    assert wait_idle(pool)["in_use"] == 0


@pytest.mark.slow
def test_a_killed_pools_slab_table_is_removed_by_the_next_pool(shm_dir: Path) -> None:
    """Issue 46, finding 8: a SIGKILLed pool left its slab table in the shm directory for good; the next pool there
    removes the tables of pools that are gone (and of no live one)."""
    shm = shm_dir
    killed = start_pool(*SMALL_POOL, "--slabs", "--shm-dir", str(shm))
    live = start_pool(*SMALL_POOL, "--slabs", "--shm-dir", str(shm))
    try:
        tables = set(shm.glob("kvpool-slabs-*"))
        assert len(tables) == 2
        killed.proc.kill()
        killed.proc.wait(10)
        assert set(shm.glob("kvpool-slabs-*")) == tables  # nobody removed it
        after = start_pool(*SMALL_POOL, "--slabs", "--shm-dir", str(shm))
        try:
            left = set(shm.glob("kvpool-slabs-*"))
            assert len(left) == 2 and len(left & tables) == 1  # the live pool's and the new one's
        finally:
            after.stop()
    finally:
        live.stop()
        killed.stop()  # where an assertion failed before the kill, it still runs


def test_a_slab_claim_that_times_out_says_how_long_it_waited(pool: LocalPool) -> None:
    """Issue 46, finding 8: a slab box's claim polled the pool with no wait, and its time-out said "within 0.0s"."""
    with SlabClient(pool.url, name="slab-wait", slab=SMALL) as q:
        assert q.slab_box is not None and q.slab_box.sock is not None
        with pytest.raises(HandoffNotFound, match=r"no handoff 'req-none' within 0\.3s"):
            q.claim("req-none", timeout_s=0.3)
        with pytest.raises(HandoffNotFound, match=r"within 0\.2s"):
            q.claim(None, timeout_s=0.2)


def test_a_ring_entry_the_producers_slots_do_not_vouch_for_is_dropped(pool: LocalPool) -> None:
    """The ring lies in the producer's region, which only it writes: an entry naming slots that its region does not
    show handed to this consumer under the entry's sequence (allocated still, or past the slab) is dropped."""
    with SlabClient(pool.url, name="slab-o", slab=SMALL) as p, SlabClient(pool.url, name="slab-n", slab=SMALL) as q:
        first = p.alloc(1)
        p.handoff("req-pairing", first, 1, to="slab-n")
        assert q.claim("req-pairing", timeout_s=5).block_ids == first
        assert p.slab is not None and q.slab is not None and p.slab_sender is not None
        view, kept = p.slab.view, p.alloc(2)
        run = int(p.slab.slot_of[block_of(kept[0])])
        peer, capacity = p.slab_sender.peers["slab-n"], p.slab.capacity
        for request_id, slot in (("req-not-handed", run), ("req-past", capacity - 1)):
            seq = view.words[HSEQ] = view.words[HSEQ] + 1
            payload = array("q", kept).tobytes() + request_id.encode()
            at = view.ring + seq % RING * ENTRY
            ENTRY_HEAD.pack_into(view.rw, at, seq, peer.last_ring, 0, peer.nonce, 2, peer.region, 2, slot,
                                 len(request_id), 0)  # fmt: skip
            view.rw[at + ENTRY_HEAD.size : at + ENTRY_HEAD.size + len(payload)] = payload
            view.words[peer.bell] = peer.last_ring = seq
            with pytest.raises(HandoffNotFound):
                q.claim(request_id, timeout_s=0.2)
        seq = view.words[HSEQ] = view.words[HSEQ] + 1
        view.words[peer.bell] = seq  # a bell with no entry behind it: dropped once, not read again and again
        with pytest.raises(HandoffNotFound):
            q.claim(None, timeout_s=0.2)
        assert q.slab_box is not None and q.slab_box.watched[p.slab.info.region, info_nonce(p)].last == seq
        ids = p.alloc(1)
        p.handoff("req-true", ids, 1, to="slab-n")  # and the next true one still arrives
        assert q.claim("req-true", timeout_s=5).block_ids == ids
        assert q.free(first + ids) == 2 and p.free(kept) == 2
    assert wait_idle(pool)["in_use"] == 0


def info_nonce(client: PoolClient) -> int:
    assert client.slab is not None
    return client.slab.info.nonce


def test_a_claim_asleep_on_its_box_is_woken_by_a_handoff_through_the_ring(pool: LocalPool) -> None:
    """A consumer past its spin sleeps on its box and says so in its region: a producer that rings its bell then
    sends it a wake-up datagram (which carries nothing: the claim reads the ring)."""
    with (
        SlabClient(pool.url, name="slab-a", slab=SMALL) as p,
        SlabClient(pool.url, name="slab-b", slab=SMALL, spin_s=0.0) as q,
    ):
        recorder, _ = recorded(p, "slab-b")
        first = p.alloc(1)
        p.handoff("req-pairing", first, 1, to="slab-b")
        assert q.claim("req-pairing", timeout_s=5).block_ids == first
        assert q.slab is not None
        words = q.slab.view.words
        ids = p.alloc(2)
        words[WAITING] = 1  # as a claim does before it blocks
        p.handoff("req-awake", ids, 1, to="slab-b")
        words[WAITING] = 0
        assert recorder.sent[-1] == b"\0"
        assert q.claim("req-awake", timeout_s=5).block_ids == ids
        later = p.alloc(1)
        timer = threading.Timer(0.3, lambda: p.handoff("req-later", later, 1, to="slab-b"))
        timer.start()
        assert q.claim("req-later", timeout_s=10).block_ids == later  # asleep most of the time it waits
        timer.join()
        assert q.free(first + ids + later) == 4
    assert wait_idle(pool)["in_use"] == 0


def test_a_stale_id_among_a_run_goes_to_the_pool_which_refuses_it(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-v", slab=SMALL) as p, SlabClient(pool.url, name="slab-w", slab=SMALL) as q:
        ids = p.alloc(3)
        assert p.free(ids[2:]) == 1
        with pytest.raises(StaleBlock):
            p.handoff("req-stale-run", ids, 3, to="slab-w")
        with pytest.raises(HandoffRefused, match="StaleBlock"):
            q.claim("req-stale-run", timeout_s=5)  # the pool tells the addressee
        assert p.free(ids[:2]) == 2  # nothing changed: still the producer's
    assert wait_idle(pool)["in_use"] == 0


def test_a_run_its_producers_region_does_not_vouch_for_is_dropped(pool: LocalPool) -> None:
    """A producer holds the pair's key, so its seal proves nothing about the slots: a run that names blocks its
    region does not show handed to this consumer under this sequence (allocated still, or in other slots), or
    slots past the slab, is dropped."""
    with SlabClient(pool.url, name="slab-x", slab=SMALL) as p, SlabClient(pool.url, name="slab-y", slab=SMALL) as q:
        assert q.slab_box is not None and q.slab is not None
        recorder, path = recorded(p, "slab-y")
        ids = p.alloc(2)
        p.handoff("req-true", ids, 2, to="slab-y")
        assert q.claim("req-true", timeout_s=5).block_ids == ids
        datagram = memoryview(recorder.sent[0])
        key = q.slab_box.keys[wire.peek(datagram)]  # type: ignore[index]
        h = wire.decode(datagram, key)
        assert h is not None and h.run >= 0
        kept = p.alloc(2)
        assert p.slab is not None
        first = int(p.slab.slot_of[block_of(kept[0])])  # the run they sit in, allocated, not handed
        out, capacity = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), q.slab.capacity
        lies = (("req-not-handed", first), ("req-other-slots", h.run), ("req-past", capacity - 1))
        for n, (request_id, run) in enumerate(lies):
            lie = wire.encode(key, h.from_region, h.from_nonce, h.seq + 1 + n, request_id, 2, b"", b"",
                                  array("q", kept).tobytes(), run)  # fmt: skip
            out.sendto(lie, path)
            with pytest.raises(HandoffNotFound):
                q.claim(request_id, timeout_s=0.2)
        out.close()
        assert q.free(ids) == 2 and p.free(kept) == 2
    assert wait_idle(pool)["in_use"] == 0


def test_a_run_naming_other_ids_under_the_real_sequence_is_dropped(pool: LocalPool) -> None:
    """The one lie a run's sequence, states and nonces cannot catch: other ids (held by the same producer) under the
    sequence of a handoff whose own datagram has not arrived yet. The ids' column differs, so it is dropped, and
    the real one is taken after it."""
    with SlabClient(pool.url, name="slab-l", slab=SMALL) as p, SlabClient(pool.url, name="slab-m", slab=SMALL) as q:
        assert q.slab_box is not None and p.slab_sender is not None
        p.slab_sender.use_ring = False  # the datagrams' case: a ring is read where it lies, no copy can be held back
        recorder, path = recorded(p, "slab-m")
        p.handoff("req-pairing", p.alloc(1), 1, to="slab-m")
        q.free(q.claim("req-pairing", timeout_s=5).ids)
        ids, other = p.alloc(2), p.alloc(2)
        recorder.hold = True
        p.handoff("req-real", ids, 2, to="slab-m")
        real = memoryview(recorder.sent[-1])
        key = q.slab_box.keys[wire.peek(real)]  # type: ignore[index]
        h = wire.decode(real, key)
        assert h is not None and h.run >= 0
        other_ids = array("q", other).tobytes()
        lie = wire.encode(key, h.from_region, h.from_nonce, h.seq, "req-lie", 2, b"", b"", other_ids, h.run)
        out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        out.sendto(lie, path)
        with pytest.raises(HandoffNotFound):
            q.claim("req-lie", timeout_s=0.2)
        out.sendto(real, path)
        out.close()
        assert q.claim("req-real", timeout_s=5).block_ids == ids
        assert q.free(ids) == 2 and p.free(other) == 2
    assert wait_idle(pool)["in_use"] == 0


def test_ids_of_idle_slab_blocks_are_not_handed(pool: LocalPool) -> None:
    """Ids that name blocks idle in the slab, at their current generations (never returned by an alloc, or freed
    and read back from the slab's region), in consecutive slots: refused, and the slab as it was."""
    with SlabClient(pool.url, name="slab-i", slab=SMALL) as p, SlabClient(pool.url, name="slab-j", slab=SMALL) as q:
        assert p.slab is not None and p.slab_sender is not None
        slab = p.slab
        p.free(p.alloc(1))
        p.slab_sender._peer("slab-j")
        top = slab.num_idle
        slots = [int(s) for s in slab.idle[top - 2 : top][::-1]]  # the next alloc's, ascending
        assert slots[1] == slots[0] + 1
        idle = [int(slab.block[s]) for s in slots]
        with pytest.raises(NotOwner):
            p.handoff("req-idle", idle, 2, to="slab-j")
        assert slab.num_idle == top and [int(slab.block[s]) for s in slots] == idle
        with pytest.raises(HandoffNotFound):
            q.claim("req-idle", timeout_s=0.2)
        assert p.alloc(2) == idle  # the next alloc hands them out, as it would have
        assert p.free(idle) == 2
    assert wait_idle(pool)["in_use"] == 0


def test_forged_tampered_and_replayed_slab_handoffs_are_refused(pool: LocalPool) -> None:
    with SlabClient(pool.url, name="slab-f", slab=SMALL) as p, SlabClient(pool.url, name="slab-g", slab=SMALL) as q:
        recorder, path = recorded(p, "slab-g")
        ids = p.alloc(2)
        p.handoff("req-real", ids, 4, to="slab-g")
        assert q.claim("req-real", timeout_s=5).block_ids == ids
        datagram, out = recorder.sent[0], socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        out.sendto(datagram, path)  # the same datagram again: a replay
        tampered = bytearray(datagram)
        tampered[wire.HEAD.size + 8] ^= 1  # another block id, under the pair's seal
        out.sendto(bytes(tampered), path)
        h = wire.decode(memoryview(datagram), q.slab_box.keys[wire.peek(memoryview(datagram))])
        assert h is not None
        forged = wire.encode(secrets.token_bytes(32), h.from_region, h.from_nonce, h.seq + 1, "req-forged", 4, b"",
                                 h.slots.tobytes(), h.packed.tobytes(), h.run)  # fmt: skip
        out.sendto(forged, path)
        out.close()
        for request_id in ("req-real", "req-forged", None):
            with pytest.raises(HandoffNotFound):
                q.claim(request_id, timeout_s=0.2)
        assert q.free(ids) == 2
    wait_idle(pool)


def test_the_pools_flag_drains_a_slab_when_others_need_room(pool: LocalPool) -> None:
    big = SlabConfig(blocks=40, low=1, high=48)
    with SlabClient(pool.url, name="slab-h", slab=big) as hoarder, PoolClient(pool.url, name="plain") as b:
        mine = hoarder.alloc(1)
        assert stats(pool)["in_use"] >= 41
        with pytest.raises(PoolExhausted):
            b.alloc(30)  # 507: the hoarder's slab holds most of the pool, and is asked for its idle blocks back
        region = hoarder.slab
        assert region is not None and region.view.words[WANT] > region.view.words[DONE]
        hoarder.free(mine)  # its next call answers the flag: every idle block goes back
        assert region.num_idle == 1 and region.view.words[WANT] == region.view.words[DONE]
        b.free(b.alloc(30))
    wait_idle(pool)


DOOMED = """
import sys, time
from kvpool.slab.table import DONE, ENTRY, ENTRY_HEAD, HSEQ, RING, WAITING, WANT
from kvpool.slab import SlabClient, SlabConfig
c = SlabClient(sys.argv[1], name="slab-doomed", slab=SlabConfig(8, 2, 16), heartbeat=False)
ids = c.alloc(5)
c.handoff("req-from-the-dead", ids[:2], 8, to="slab-heir")
print(" ".join(map(str, ids[:2])), flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_a_killed_sessions_slab_comes_back_and_its_handed_blocks_reach_the_consumer(process: PoolProcess) -> None:
    pool = process
    with SlabClient(pool.url, name="slab-heir", slab=SMALL) as heir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", DOOMED, pool.url], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            handed = [int(x) for x in proc.stdout.readline().split()]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert len(handed) == 2
        deadline = time.monotonic() + 10
        while stats(pool)["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = stats(pool)
        assert s["sessions"] == 1 and s["in_use"] == 2  # its slab came back; the two it handed are the heir's
        got = heir.claim("req-from-the-dead", timeout_s=5)  # its region is gone: the pool vouches instead
        assert got.block_ids == handed
        assert heir.free(got.ids) == 2
    assert wait_idle(pool)["in_use"] == 0


RING_DOOMED = """
import sys, time
from kvpool.slab import SlabClient, SlabConfig
c = SlabClient(sys.argv[1], name="slab-ring-doomed", slab=SlabConfig(24, 4, 48))
c.handoff("req-ring-pairing", c.alloc(1), 1, to="slab-ring-heir")
print("paired", flush=True)
sys.stdin.readline()  # the heir took it: it reads this slab's ring from now on
for i in range(10):
    c.handoff(f"req-ring-{i}", c.alloc(2), 8, {"i": i}, to="slab-ring-heir")
print("handed", flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_a_killed_producers_ring_handoffs_reach_their_consumer_through_the_pool(process: PoolProcess) -> None:
    """Handoffs written into a producer's ring that its consumer had not read when the producer was SIGKILLed: the
    ring goes with the producer's region, so the pool parks each for that consumer (it had given the blocks to the
    consumer, which never learnt their ids: 20 blocks held by a live session that knew nothing of them)."""
    pool = process
    with SlabClient(pool.url, name="slab-ring-heir", slab=SMALL) as heir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", RING_DOOMED, pool.url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "paired"
            heir.free(heir.claim("req-ring-pairing", timeout_s=5).ids)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "handed"
            assert heir.slab_box is not None and heir.slab is not None
            (watched,) = heir.slab_box.watching
            assert heir.slab.view.all_words[watched.bell] == watched.last + 10  # all ten in its ring, unread
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10
        while stats(pool)["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats(pool)["sessions"] == 1
        got = [heir.claim(f"req-ring-{i}", timeout_s=5) for i in range(10)]
        assert [c.meta for c in got] == [{"i": i} for i in range(10)] and all(len(c.block_ids) == 2 for c in got)
        with pool.http() as http:
            held = http.get(f"/sessions/{heir.session_id}/blocks").json()["block_ids"]
        assert sorted(held) == sorted(i for c in got for i in c.block_ids)  # nothing it was not told of
        assert heir.free([i for c in got for i in c.ids]) == 20
    assert wait_idle(pool)["in_use"] == 0


def test_an_idle_client_answers_the_flag_at_its_heartbeat(pool: LocalPool) -> None:
    big = SlabConfig(blocks=40, low=1, high=48)
    with SlabClient(pool.url, name="slab-i", slab=big) as idle, PoolClient(pool.url, name="plain-2") as b:
        idle.free(idle.alloc(1))  # a slab of 41 idle blocks, then nothing more from this client
        with pytest.raises(PoolExhausted):
            b.alloc(30)
        deadline = time.monotonic() + 10
        while stats(pool)["slabs"]["slab_idle"] and time.monotonic() < deadline:
            time.sleep(0.05)
        b.free(b.alloc(30))
    wait_idle(pool)


def test_a_heartbeat_that_comes_by_while_the_client_closes_finds_nothing_to_do(pool: LocalPool) -> None:
    """The heartbeat's thread answers the pool's flag; the client may close its slab meanwhile (the view's memory
    released under the beat's feet raised in that thread)."""
    with SlabClient(pool.url, name="slab-closing", slab=SMALL) as c:
        c.free(c.alloc(1))
        slab = c.slab
        assert slab is not None
        c._close_slab()
        slab.answer_want()  # what the beat does if it read the slab before close took it away
    wait_idle(pool)


def test_a_client_paused_past_its_lease_hands_out_nothing_from_its_old_slab(pool: LocalPool) -> None:
    # over TCP, where the pool cannot know the process: its blocks are released at once, as the test needs (over the
    # Unix socket they would stay quarantined while this process lives: tests/server/books/test_quarantine.py)
    with SlabClient(pool.tcp_url, name="slab-z", slab=SMALL, heartbeat=False) as z:
        ids = z.alloc(1)
        deadline = time.monotonic() + 10
        while stats(pool)["sessions"] and time.monotonic() < deadline:  # its lease (1 s) runs out
            time.sleep(0.05)
        with pytest.raises(UnknownSession):
            z.alloc(1)
        with pytest.raises(UnknownSession):
            z.free(ids)
    assert wait_idle(pool)["in_use"] == 0


LIED_TO = """
import sys, time
from kvpool.errors import HandoffNotFound
from kvpool.slab import SlabClient, SlabConfig
with SlabClient(sys.argv[1], name="slab-lied-to", slab=SlabConfig(8, 2, 16)) as c:
    print("up", flush=True)
    got = c.claim("req-pairing", timeout_s=10)
    c.free(got.ids)
    print("paired", flush=True)
    sys.stdin.readline()  # the producer has written its lies
    for request_id in ("req-lie", None):
        t0 = time.monotonic()
        try:
            c.claim(request_id, timeout_s=1.0)
            print("claimed", flush=True)
        except HandoffNotFound:
            print(f"timed out {time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["prev-is-itself", "prev-goes-up", "a-cycle"])
def test_a_ring_entry_whose_chain_does_not_go_down_cannot_hang_its_consumer(process: PoolProcess, lie: str) -> None:
    """Whatever a producer writes into its region is untrusted: a ring entry whose ``prev`` names itself, a later
    sequence, or a chain that comes back on itself must not keep its consumer's claim walking (it grew by a gigabyte in
    ten seconds and never returned): the claim drops it and answers within its time-out."""
    pool = process
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    consumer = subprocess.Popen([sys.executable, "-c", LIED_TO, pool.url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert consumer.stdin is not None and consumer.stdout is not None
    try:
        with SlabClient(pool.url, name="slab-liar", slab=SMALL) as p:
            assert consumer.stdout.readline().strip() == "up"
            first = p.alloc(1)
            p.handoff("req-pairing", first, 1, to="slab-lied-to")
            assert consumer.stdout.readline().strip() == "paired"  # it watches p's ring from now on
            assert p.slab is not None and p.slab_sender is not None
            view, peer = p.slab.view, p.slab_sender.peers["slab-lied-to"]
            top = view.words[HSEQ] + 3
            prevs = {"prev-is-itself": {top: top}, "prev-goes-up": {top: top + 5, top + 5: top},
                     "a-cycle": {top: top - 1, top - 1: top}}[lie]  # fmt: skip
            for seq, prev in prevs.items():
                at = view.ring + seq % RING * ENTRY
                ENTRY_HEAD.pack_into(view.rw, at, seq, prev, 0, peer.nonce, 1, peer.region, 1, 0, 7, 0)
                view.rw[at + ENTRY_HEAD.size : at + ENTRY_HEAD.size + 15] = array("q", first).tobytes() + b"req-lie"
            view.words[HSEQ] = top
            view.words[peer.bell] = top
            consumer.stdin.write("go\n")
            consumer.stdin.flush()
            deadline = time.monotonic() + 15
            answers = []
            for _ in range(2):
                ready = select.select([consumer.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
                assert ready, f"the consumer's claim never returned ({lie})"
                answers.append(consumer.stdout.readline().strip())
            for answer in answers:
                assert answer.startswith("timed out") and float(answer.split()[-1]) < 1.0 + 2.0, answers
    finally:
        consumer.kill()
        consumer.wait()
    assert wait_idle(pool)["in_use"] == 0
