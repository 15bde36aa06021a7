"""The fence: a lapsed session's writable blocks stay out of use while its process lives (issue 45, finding 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client import PoolClient
from kvpool.errors import PoolExhausted
from kvpool.ids import BLOCK_MASK
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.books.processes import Peer
from kvpool.server.books.quarantine import Quarantine, holder_of
from kvpool.server.books.slabs import SlabBooks
from tests.conftest import PoolProcess, start_pool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeProcesses:
    """A process table: peers run until the test ends them; ``kill`` ends them where ``may_kill`` allows."""

    def __init__(self, may_kill: bool = True) -> None:
        self.running: set[Peer] = set()
        self.may_kill = may_kill
        self.signalled: list[Peer] = []

    def spawn(self, pid: int, start: int = 1) -> Peer:
        peer = Peer(pid, 1000, 1000, start)
        self.running.add(peer)
        return peer

    def alive(self, peer: Peer) -> bool:
        return any((p.pid, p.start) == (peer.pid, peer.start) for p in self.running)  # a process: pid, start time

    def kill(self, peer: Peer) -> str | None:
        if not self.may_kill:
            return "another user's process"
        self.signalled.append(peer)  # SIGKILL is delivered; the process is gone once the kernel reaps it
        return None


def balanced(pool: Pool) -> dict[str, int]:
    s = pool.stats()
    assert s["free"] + s["in_use"] + s["cached"] + s["quarantined"] == s["num_blocks"], s
    assert min(s["free"], s["in_use"], s["cached"], s["quarantined"]) >= 0, s
    for arena in s["arenas"]:
        assert sum(arena.values()) == s["num_blocks"], arena
    pool.allocator.check()
    if pool.quarantine is not None:
        pool.quarantine.check(pool.allocator.refs_of)
    return s


def make_pool(clock: Clock, procs: FakeProcesses, n: int = 16, mode: str = "quarantine") -> Pool:
    return Pool(n, KVLayout(block_size=4), lease_ttl_s=2.0, clock=clock, quarantine=Quarantine(procs, mode))  # type: ignore[arg-type]


def lapse(pool: Pool, clock: Clock) -> None:
    clock.now += 3.0
    pool.expire()


# -- the quarantine on its own ---------------------------------------------------------------------------


def test_a_fenced_entry_stays_until_its_process_is_gone_and_a_reused_pid_is_another_process() -> None:
    procs = FakeProcesses()
    peer = procs.spawn(42, start=7)
    q = Quarantine(procs)
    assert q.lapsed("s1", "engine", peer, [3, 4, 4], released=2) == holder_of("s1")
    assert q.num_blocks == 2 and q.gone() == []
    procs.running.discard(peer)
    procs.spawn(42, start=8)  # the pid went to a new process: the fenced one is gone all the same
    assert [e.session_id for e in q.gone()] == ["s1"]
    assert q.num_blocks == 0 and q.stats()["released"] == 1 and q.stats()["blocks_released"] == 2


def test_a_session_with_no_known_process_or_nothing_writable_is_not_fenced() -> None:
    procs = FakeProcesses()
    q = Quarantine(procs)
    assert q.lapsed("s1", "tcp", None, [1, 2], released=0) is None
    assert q.lapsed("s2", "done", procs.spawn(5), [], released=3) is None
    assert q.num_blocks == 0 and q.stats()["quarantines"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.lists(st.integers(0, 15), max_size=5)), max_size=20))
def test_the_held_count_is_always_the_entries_union(steps: list[tuple[bool, int, list[int]]]) -> None:
    """Lapses (several per process, blocks shared between entries) and deaths in any order: ``num_blocks`` is the
    union of the entries' blocks, and an entry leaves exactly when its process is gone."""
    procs = FakeProcesses()
    peers = [procs.spawn(100 + i) for i in range(4)]
    q = Quarantine(procs)
    refs: dict[str, dict[int, int]] = {}
    for n, (dies, who, blocks) in enumerate(steps):
        if dies:
            procs.running.discard(peers[who])
            for entry in q.gone():
                assert entry.peer == peers[who] and not procs.alive(entry.peer)
                del refs[entry.holder]
        else:
            holder = q.lapsed(f"s{n}", "x", peers[who], blocks, released=0)
            if holder is not None:
                refs[holder] = {b: blocks.count(b) for b in blocks}
        q.check(lambda h: refs.get(h, {}))
        assert all(procs.alive(e.peer) for e in q.fenced.values())
        assert q.num_blocks == len({b for r in refs.values() for b in r})


# -- in the pool -----------------------------------------------------------------------------------------


def test_a_lapsed_live_process_keeps_its_uncommitted_blocks_from_everyone_until_it_is_gone() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    stalled = procs.spawn(4242)
    sid = pool.open_session("engine-a", "both", peer=stalled).session_id
    ids = pool.alloc(sid, 6)
    pool.commit(sid, ids[:2], list(range(8)))  # two committed blocks: immutable, hits for others
    lapse(pool, clock)
    s = balanced(pool)
    assert s["quarantined"] == 4 and s["quarantine"]["blocks"] == 4 and s["quarantine"]["processes"] == 1
    fenced = set(ids[2:])

    other = pool.open_session("engine-b", "both").session_id
    assert pool.lookup(other, list(range(8))).block_ids == ids[:2]  # KV outlives its engine
    got = pool.alloc(other, 16 - 6)
    assert not {b & 0xFFFFFFFF for b in got} & {b & 0xFFFFFFFF for b in fenced}
    with pytest.raises(PoolExhausted):
        pool.alloc(other, 1)
    balanced(pool)

    procs.running.discard(stalled)
    pool.expire()
    s = balanced(pool)
    assert s["quarantined"] == 0 and s["quarantine"]["released"] == 1
    assert len(pool.alloc(other, 4)) == 4


def test_a_session_with_no_known_process_is_released_at_once_as_before() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    sid = pool.open_session("over-tcp", "both").session_id
    pool.alloc(sid, 5)
    lapse(pool, clock)
    s = balanced(pool)
    assert s["quarantined"] == 0 and s["free"] == 16


def test_a_session_whose_process_died_already_is_released_at_once() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    crashed = procs.spawn(8)
    sid = pool.open_session("engine", "both", peer=crashed).session_id
    pool.alloc(sid, 5)
    procs.running.discard(crashed)
    lapse(pool, clock)
    s = balanced(pool)
    assert s["quarantined"] == 0 and s["free"] == 16 and s["quarantine"]["quarantines"] == 0


def test_an_explicit_close_releases_at_once_whatever_the_process() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    sid = pool.open_session("engine", "both", peer=procs.spawn(9)).session_id
    pool.alloc(sid, 5)
    pool.close_session(sid)
    assert balanced(pool)["free"] == 16


def test_a_tcp_session_renewed_over_the_unix_socket_takes_its_process() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    sid = pool.open_session("engine", "both", peer=Peer.tcp("loopback")).session_id
    pool.alloc(sid, 3)
    pool.heartbeat(sid, procs.spawn(77))
    lapse(pool, clock)
    assert balanced(pool)["quarantined"] == 3


def test_kill_mode_kills_the_lapsed_process_and_releases_once_it_is_gone() -> None:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs, mode="kill")
    engine = procs.spawn(31)
    sid = pool.open_session("engine", "both", peer=engine).session_id
    pool.alloc(sid, 4)
    lapse(pool, clock)
    assert procs.signalled == [engine]
    s = balanced(pool)
    assert s["quarantined"] == 4 and s["quarantine"]["killed"] == 1
    procs.running.discard(engine)  # the kernel reaped it
    pool.expire()
    assert balanced(pool)["quarantined"] == 0


def test_kill_mode_quarantines_a_process_it_may_not_kill() -> None:
    clock, procs = Clock(), FakeProcesses(may_kill=False)
    pool = make_pool(clock, procs, mode="kill")
    sid = pool.open_session("engine", "both", peer=procs.spawn(31)).session_id
    pool.alloc(sid, 4)
    lapse(pool, clock)
    s = balanced(pool)
    assert s["quarantined"] == 4 and s["quarantine"]["killed"] == 0 and s["quarantine"]["kills_refused"] == 1


def test_a_lapse_found_by_the_session_s_own_late_call_fences_too() -> None:
    """The stalled engine resumes and calls before the sweep ran: its lapse is found there, and fenced the same."""
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs)
    sid = pool.open_session("engine", "both", peer=procs.spawn(5)).session_id
    pool.alloc(sid, 4)
    clock.now += 3.0
    with pytest.raises(Exception, match="unknown session"):
        pool.heartbeat(sid)
    assert balanced(pool)["quarantined"] == 4


@pytest.fixture
def slab_pool(tmp_path: Path) -> Iterator[tuple[Pool, SlabBooks, Clock, FakeProcesses]]:
    clock, procs = Clock(), FakeProcesses()
    pool = make_pool(clock, procs, n=32)
    books = pool.open_slabs(tmp_path, regions=4, slots=16, box_dir=tmp_path)
    yield pool, books, clock, procs
    books.close()


def test_a_lapsed_slab_s_idle_blocks_are_quarantined_and_no_refill_takes_them(slab_pool) -> None:
    pool, books, clock, procs = slab_pool
    stalled = pool.open_session("engine-a", "both", peer=procs.spawn(11)).session_id
    books.open(stalled)
    reserved = {b & 0xFFFFFFFF for b in books.grant(stalled, 12, [])}
    lapse(pool, clock)
    assert balanced(pool)["quarantined"] == 12
    other = pool.open_session("engine-b", "both").session_id
    books.open(other)
    refill = {b & 0xFFFFFFFF for b in books.grant(other, 16, [])}
    assert len(refill) == 16 and not refill & reserved
    with pytest.raises(PoolExhausted):
        pool.alloc(other, 5)
    balanced(pool)


# -- with real processes: an engine stopped past its lease -------------------------------------------------

NUM_BLOCKS = 16
HELD = 6
#: a client that opens a session over the pool's Unix socket, allocates, prints its block ids and waits
ENGINE = """
import sys, time
from kvpool.client import PoolClient
client = PoolClient(sys.argv[1], name="stalled-engine", fast=False)
print(" ".join(str(i) for i in client.alloc(int(sys.argv[2]))), flush=True)
time.sleep(600)
"""


def wait_for(what: Callable[[], bool], deadline_s: float = 30.0) -> None:
    until = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < until, "not within the deadline"
        time.sleep(0.05)


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> Iterator[PoolProcess]:
    mode = getattr(request, "param", "quarantine")
    p = start_pool(
        "--num-blocks", str(NUM_BLOCKS), "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
        "--block-size", "4", "--lease-ttl-s", "1", "--lapsed-sessions", mode,
    )  # fmt: skip
    yield p
    p.stop()


@pytest.fixture
def engine(pool: PoolProcess) -> Iterator[tuple[subprocess.Popen[str], set[int]]]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, pool.url, str(HELD)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    held = {int(i) & BLOCK_MASK for i in proc.stdout.readline().split()}
    assert len(held) == HELD
    yield proc, held
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_an_engine_stopped_past_its_lease_keeps_its_blocks_from_others_until_it_is_killed(pool, engine) -> None:
    proc, held = engine
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: pool.stats()["quarantined"] == HELD)
    s = pool.stats()
    assert s["sessions"] == 0 and s["free"] + s["in_use"] + s["cached"] + s["quarantined"] == NUM_BLOCKS
    with PoolClient(pool.url, name="other-engine", fast=False) as other:
        got = {i & BLOCK_MASK for i in other.alloc(NUM_BLOCKS - HELD)}  # the whole arena that is not fenced
        assert not got & held
        with pytest.raises(PoolExhausted):
            other.alloc(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: pool.stats()["quarantined"] == 0)
        assert {i & BLOCK_MASK for i in other.alloc(HELD)} == held
        fence = other.stats()["quarantine"]
        assert (fence["quarantines"], fence["released"], fence["killed"]) == (1, 1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["kill"], indirect=True)
def test_with_lapsed_sessions_kill_the_pool_kills_a_stopped_engine_and_takes_its_blocks_back(pool, engine) -> None:
    proc, _ = engine
    os.kill(proc.pid, signal.SIGSTOP)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: pool.stats()["quarantine"]["released"] == 1)
    s = pool.stats()
    assert s["quarantined"] == 0 and s["quarantine"]["killed"] == 1
    with PoolClient(pool.url, name="other-engine", fast=False) as other:
        assert len(other.alloc(NUM_BLOCKS)) == NUM_BLOCKS
    with pool.http() as http:
        metrics = http.get("/metrics").text
    assert "kvpool_lapsed_killed_total 1.0" in metrics and 'kvpool_blocks{state="quarantined"} 0.0' in metrics
