"""A pool served in the test process: reached at its ``local://`` url like any pool, stopped like a process."""

from __future__ import annotations

import threading

import pytest

from kvpool.client import PoolClient
from kvpool.errors import PoolUnavailable
from kvpool.server.transports.local import LocalPool
from tests.conftest import SMALL_POOL, local_pool


def test_a_client_reaches_a_local_pool_by_its_url_over_both_channels(pool_server: LocalPool) -> None:
    with PoolClient(pool_server.url, name="fast") as fast, PoolClient(pool_server.url, name="http", fast=False) as h:
        assert fast.transport.fast_path is not None and h.transport.fast_path is None
        ids = fast.alloc(3)
        fast.handoff("r", ids, 12, to="http")
        claim = h.claim("r", timeout_s=5)
        assert claim.num_tokens == 12 and len(claim.block_ids) == 3
        assert pool_server.plane.pool.stats()["in_use"] == 3
        h.free(claim.block_ids)
    assert pool_server.stats()["in_use"] == 0 and pool_server.stats()["sessions"] == 0


def test_a_claim_waiting_when_the_pool_stops_is_answered_and_the_url_then_names_no_pool() -> None:
    pool = local_pool(*SMALL_POOL)
    errors: list[Exception] = []
    with PoolClient(pool.url, name="d", fast=False, heartbeat=False) as client:

        def wait() -> None:
            try:
                client.claim("never", timeout_s=60)
            except Exception as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        while not pool.plane.claims.waiting:
            waiter.join(0.01)
        pool.stop()
        waiter.join(30)
        assert not waiter.is_alive() and [type(e) for e in errors] == [PoolUnavailable]
        with pytest.raises(PoolUnavailable, match="no pool is served in this process"):
            PoolClient(pool.url, name="late")
