"""A pool stopped (SIGSTOP, a frozen cgroup) for longer than the lease, while its clients heartbeat all along."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpool.client import PoolClient
from tests.conftest import start_pool

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'
FLAGS = (
    "--num-blocks", "32", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32", "--lease-ttl-s", "1",
)  # fmt: skip


def test_a_pool_stopped_past_the_lease_expires_no_client_that_heartbeat_meanwhile():
    pool = start_pool(*FLAGS)
    try:
        with PoolClient(pool.url, name="a") as a, PoolClient(pool.url, name="b") as b:
            held = {a: a.alloc(3), b: b.alloc(2)}
            os.kill(pool.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(4.0)  # four leases; the clients' heartbeats wait in the pool's sockets
            finally:
                os.kill(pool.proc.pid, signal.SIGCONT)
            time.sleep(2.0)  # two leases more, running: the heartbeats keep them alive
            for client, ids in held.items():
                assert client.free(ids) == len(ids)  # still its blocks: the session lived through the pause
            assert pool.stats()["counters"]["sessions_expired"] == 0
    finally:
        pool.stop()
