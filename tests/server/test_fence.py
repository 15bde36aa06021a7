"""The fence with real processes: an engine stopped past its lease keeps its blocks from everyone until it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.client import PoolClient
from kvpool.errors import PoolExhausted
from kvpool.ids import BLOCK_MASK
from tests.conftest import PoolProcess, start_pool

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
