"""A worker killed with SIGKILL loses nothing: within its lease TTL plus one second, the pool has released its
allocated blocks, its prefix refs and its parked handoff, and the books balance at every sample on the way.

Real processes throughout: the pool is a ``kvpool serve`` subprocess, each worker a Python subprocess using
:class:`PoolClient` (fast channel or plain HTTP), and the kill is a real SIGKILL (no ``finally``, no atexit).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvpool.client import PoolClient
from kvpool.errors import HandoffNotFound, HandoffRefused, NotOwner
from tests.conftest import ROOT, PoolProcess, start_pool
from tests.server.balance import assert_balanced

LEASE_TTL_S = 1.0
NUM_BLOCKS = 64
BLOCK_SIZE = 4

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'
PREFIX = list(range(500, 508))  # two full blocks
LAYOUT = (
    "--num-blocks", str(NUM_BLOCKS), "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", str(BLOCK_SIZE), "--dtype", "float32", "--lease-ttl-s", str(LEASE_TTL_S),
)  # fmt: skip


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    held: dict[str, Any]

    def kill(self) -> float:
        """SIGKILL the worker; return the moment it was sent (the clock the deadline counts from)."""
        t0 = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        assert self.proc.returncode == -signal.SIGKILL
        return t0


def spawn_workers(pool: PoolProcess, names: list[str], *extra: str) -> list[Worker]:
    """Start the workers together (each takes a second or two to import and map), then read their reports."""
    procs = []
    for name in names:
        args = [sys.executable, "-m", "tests.reliability.crash_worker", pool.url, json.dumps(PREFIX), "--name", name]
        procs.append(subprocess.Popen(
            [*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ))  # fmt: skip
    workers = []
    for name, proc in zip(names, procs, strict=True):
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"worker {name} died before reporting:\n{proc.stderr.read()}")
        workers.append(Worker(proc, json.loads(line)))
    return workers


def wait_for(pool: PoolProcess, done: Any, deadline: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Sample /stats until ``done(stats)`` or the deadline; every sample must balance."""
    samples = []
    while True:
        stats = pool.stats()
        assert_balanced(stats)
        samples.append(stats)
        if done(stats) or time.monotonic() > deadline:
            return stats, samples
        time.sleep(0.05)


@pytest.fixture
def crash_pool(request: pytest.FixtureRequest) -> Iterator[PoolProcess]:
    flags = getattr(request, "param", ())
    pool = start_pool(*LAYOUT, *flags)
    yield pool
    pool.stop()
    assert "Traceback" not in pool.output(), pool.output()[-3000:]


@pytest.fixture
def survivor(crash_pool: PoolProcess) -> Iterator[PoolClient]:
    """A live session that committed PREFIX (then freed it: cached) and holds one block of its own throughout."""
    with PoolClient(crash_pool.url, name="survivor") as client:
        blocks = client.alloc(2)
        assert client.commit(blocks, PREFIX).committed == 2
        client.free(blocks)
        yield client


def only_survivor_left(survivor_blocks: int) -> Any:
    """The books once every dead worker's refs are gone: the survivor's blocks in use, its session, no handoff."""

    def done(stats: dict[str, Any]) -> bool:
        return stats["in_use"] == survivor_blocks and stats["handoffs"] == 0 and stats["sessions"] == 1

    return done


# (pool flags, worker flags): the handoff's lifetime from its own ttl_s (shorter than the pool's default) or from
# the pool's --handoff-ttl-s; the worker on the fast channel or on plain HTTP.
@pytest.mark.parametrize(("crash_pool", "worker_flags"), [
    pytest.param((), ("--handoff-ttl-s", str(LEASE_TTL_S)), id="per-handoff-ttl-fast"),
    pytest.param(("--handoff-ttl-s", "600"), ("--handoff-ttl-s", str(LEASE_TTL_S), "--no-fast"),
                 id="per-handoff-ttl-http"),
    pytest.param(("--handoff-ttl-s", str(LEASE_TTL_S)), (), id="pool-handoff-ttl-fast"),
], indirect=["crash_pool"])  # fmt: skip
def test_sigkilled_worker_releases_everything_within_lease_plus_one_second(
    crash_pool: PoolProcess, survivor: PoolClient, worker_flags: tuple[str, ...]
) -> None:
    mine = survivor.alloc(1)
    (worker,) = spawn_workers(crash_pool, ["doomed"], *worker_flags)
    held = worker.held
    assert held["fast"] == ("--no-fast" not in worker_flags)
    assert len(held["owned"]) == 3 and len(held["parked"]) == 2
    assert len(held["hit"]) == 2, "the worker's lookup must have hit the survivor's cached prefix"

    before = crash_pool.stats()
    assert_balanced(before)
    assert before["in_use"] == 1 + 3 + 2 + 2  # survivor's block, owned, prefix hits, parked
    assert before["handoffs"] == 1 and before["sessions"] == 2 and before["cached"] == 0

    t0 = worker.kill()
    deadline = t0 + LEASE_TTL_S + 1.0
    released = only_survivor_left(1)
    after, samples = wait_for(crash_pool, released, deadline)
    elapsed = time.monotonic() - t0
    assert released(after), f"after {elapsed:.2f}s still held: {after}"
    assert elapsed <= LEASE_TTL_S + 1.0
    # The prefix blocks went back to the cache (reusable), the rest to the free list.
    assert after["cached"] == 2 and after["free"] == NUM_BLOCKS - 3
    assert after["counters"]["sessions_expired"] == 1
    assert len(samples) >= 2, "the release must have been observed, not just its end"
    # The survivor is untouched and the cache still serves the prefix.
    assert survivor.lookup(PREFIX).block_ids == held["hit"]
    assert survivor.free(mine) == 1
    assert survivor.free(held["hit"]) == 2


def test_several_workers_killed_at_once_leave_the_survivors_data_alone(
    crash_pool: PoolProcess, survivor: PoolClient
) -> None:
    """Three workers die together; the survivor's blocks and bytes are untouched and all theirs come back.

    Their handoffs live 3 s (not the lease's 1 s) so that none expires while the three start up; the deadline
    is counted from that lifetime instead.
    """
    handoff_ttl_s = 3.0
    arena = survivor.arena()
    mine = survivor.alloc(4)
    for i, block in enumerate(mine):
        arena.k(1)[block].fill_(1000.0 + i)
        arena.v(1)[block].fill_(-1000.0 - i)
    workers = spawn_workers(crash_pool, [f"doomed-{i}" for i in range(3)], "--handoff-ttl-s", str(handoff_ttl_s))
    stats = crash_pool.stats()
    assert stats["sessions"] == 4 and stats["handoffs"] == 3
    assert stats["in_use"] == 4 + 3 * (3 + 2) + 2  # survivor's, each worker's owned + parked, the shared prefix
    taken = [b for w in workers for b in w.held["owned"] + w.held["parked"]]
    assert not set(taken) & set(mine), "a worker was handed a block the survivor holds"

    t0 = min(w.kill() for w in workers)
    released = only_survivor_left(4)
    after, _ = wait_for(crash_pool, released, t0 + handoff_ttl_s + 1.0)
    assert released(after), after
    for i, block in enumerate(mine):
        assert bool((arena.k(1)[block] == 1000.0 + i).all()) and bool((arena.v(1)[block] == -1000.0 - i).all())
    # Everything the workers held can be allocated again, and the survivor's blocks are not among it.
    again = survivor.alloc(NUM_BLOCKS - 4 - 2)  # all but the survivor's and the cached prefix
    assert not set(again) & set(mine)
    survivor.free(again)
    survivor.free(mine)


ADDRESSEE = """
import sys, time
from kvpool.client import PoolClient
c = PoolClient(sys.argv[1], name="decode-doomed", role="decode", inbox=True)
print(c.direct.inbox.path if c.direct.inbox else "", flush=True)
time.sleep(3600)
"""


def test_a_killed_addressee_strands_nothing(crash_pool: PoolProcess) -> None:
    """A handoff addressed to a decode worker that dies is refused once its lease is gone: its blocks come back,
    the pool deletes the dead worker's inbox, and no other session gets it, the worker restarted under the same
    name included; a claim of it says why."""
    pool = crash_pool
    proc = subprocess.Popen(
        [sys.executable, "-c", ADDRESSEE, pool.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    inbox = proc.stdout.readline().strip()
    assert inbox and os.path.exists(inbox), proc.stderr.read() if proc.stderr else ""
    with PoolClient(pool.url, name="prefill") as prefill, PoolClient(pool.url, name="rescuer") as rescuer:
        ids = prefill.alloc(3)
        prefill.handoff("stranded?", ids, 9, to="decode-doomed")  # delivered to the inbox: nobody will read it
        with pytest.raises(NotOwner, match="addressed to session 'decode-doomed'"):
            rescuer.claim("stranded?", timeout_s=0)
        t0 = Worker(proc, {}).kill()
        deadline = t0 + LEASE_TTL_S + 1.0
        while True:
            assert_balanced(pool.stats())
            try:
                rescuer.claim("stranded?", timeout_s=0)
            except NotOwner:
                assert time.monotonic() < deadline, "the dead addressee still holds the handoff"
                time.sleep(0.05)
            except HandoffRefused as exc:
                assert "session 'decode-doomed', ended before it claimed it" in str(exc)
                break
        assert pool.stats()["in_use"] == 0 and not os.path.exists(inbox)
        restarted = PoolClient(pool.url, name="decode-doomed", role="decode", inbox=True)
        with restarted, pytest.raises(HandoffNotFound):
            restarted.claim(timeout_s=0.1)
    assert pool.stats()["in_use"] == 0
