"""Pool restarts, with a real server process stopped (SIGTERM or SIGKILL) and started again on the same socket.

A client must notice the new epoch, must never again read or write through views of the old arena (its
:class:`Arena` is invalidated: every accessor raises ArenaClosed), and must either ``reconnect()`` and work
against the new arena or fail with a clear :class:`PoolRestarted`, never silently use a dead session or arena.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.arena import Arena
from kvpool.client import PoolClient
from kvpool.errors import ArenaClosed, PoolRestarted, PoolUnavailable
from kvpool.routes import HEARTBEAT, Route
from tests.conftest import PoolProcess, start_pool
from tests.server.balance import assert_balanced
from tests.server.procs import serve

LEASE_TTL_S = 1.0

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'
FLAGS = (
    "--num-blocks", "32", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32", "--lease-ttl-s", str(LEASE_TTL_S),
)  # fmt: skip


def restart(pool: PoolProcess, sig: int = signal.SIGTERM) -> PoolProcess:
    """Stop ``pool`` with ``sig`` and start a new one on the same Unix socket and TCP port."""
    pool.stop(sig)
    flags = [*FLAGS, "--socket", str(pool.socket), "--port", str(pool.port)]
    return serve(flags, port=pool.port, socket=pool.socket)


def epoch_of(pool: PoolProcess) -> str:
    return str(httpx.get(f"{pool.tcp_url}/health", timeout=5).json()["epoch"])


def assert_closed(arena: Arena) -> None:
    """Every way into the old arena's memory is shut."""
    accessors: list[Callable[[], Any]] = [lambda: arena.k(0), lambda: arena.v(1), lambda: arena.raw,
                                          lambda: arena.block(0), arena.kv_caches]  # fmt: skip
    for get in accessors:
        with pytest.raises(ArenaClosed, match="closed"):
            get()
    assert arena.closed


class Pools:
    """The pools a test started, so that each is stopped however the test ends."""

    def __init__(self) -> None:
        self.all: list[PoolProcess] = []

    def start(self) -> PoolProcess:
        self.all.append(start_pool(*FLAGS))
        return self.all[-1]

    def restart(self, pool: PoolProcess, sig: int = signal.SIGTERM) -> PoolProcess:
        self.all.append(restart(pool, sig))
        return self.all[-1]


@pytest.fixture
def pools() -> Iterator[Pools]:
    p = Pools()
    yield p
    for pool in p.all:
        pool.stop()


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_client_sees_the_new_epoch_and_reconnects(pools: Pools, sig: int, fast: bool) -> None:
    pool = pools.start()
    with PoolClient(pool.url, name="worker", fast=fast) as client:
        assert (client.transport.fast_path is not None) == fast
        old_epoch = client.epoch
        arena = client.arena()
        old_handle = arena.descriptor.handle
        ids = client.alloc(2)
        arena.k(0)[ids[0]].fill_(7.0)

        new_pool = pools.restart(pool, sig)
        new_epoch = epoch_of(new_pool)
        assert new_epoch != old_epoch

        with pytest.raises(PoolRestarted, match="restarted") as info:
            client.alloc(1)
        assert old_epoch in str(info.value) and new_epoch in str(info.value) and "reconnect()" in str(info.value)
        assert_closed(arena)
        # Until reconnect(), every call fails the same clear way, mapping the new arena included.
        for call in (lambda: client.free(ids), lambda: client.lookup([1, 2, 3, 4]), client.arena):
            with pytest.raises(PoolRestarted):
                call()
        # The old pool's arena file is gone (removed on a clean stop, or as stale by the new pool after a kill).
        assert not Path(old_handle).exists()

        client.reconnect()
        assert client.epoch == new_epoch
        fresh = client.arena()
        assert fresh is not arena and fresh.epoch == new_epoch and not fresh.closed
        new_ids = client.alloc(2)
        assert bool((fresh.k(0)[new_ids[0]] == 0).all()), "the new arena must not show the old pool's bytes"
        fresh.k(0)[new_ids[0]].fill_(3.0)
        stats = new_pool.stats()
        assert_balanced(stats)
        assert stats["in_use"] == 2 and stats["sessions"] == 1
    stats = new_pool.stats()
    assert stats["in_use"] == 0 and stats["sessions"] == 0


def test_call_while_the_pool_is_down_is_unavailable_then_restarted(pools: Pools) -> None:
    pool = pools.start()
    with PoolClient(pool.url, name="worker", heartbeat=False) as client:
        arena = client.arena()
        client.alloc(1)
        pool.stop(signal.SIGKILL)
        with pytest.raises(PoolUnavailable):
            client.alloc(1)
        assert not arena.closed, "an unreachable pool is not yet a restarted one"
        new_pool = pools.restart(pool, signal.SIGKILL)
        with pytest.raises(PoolRestarted):
            client.alloc(1)
        assert_closed(arena)
        client.reconnect()
        assert client.alloc(1) and new_pool.stats()["in_use"] == 1


def test_heartbeat_notices_a_restart_without_any_call(pools: Pools) -> None:
    """A worker busy computing makes no pool call; its heartbeat still retires the old arena within the lease."""
    pool = pools.start()
    with PoolClient(pool.url, name="busy") as client:
        arena = client.arena()
        client.alloc(1)
        pools.restart(pool)
        t0 = time.monotonic()
        while not arena.closed and time.monotonic() - t0 < 3 * LEASE_TTL_S + 2:
            time.sleep(0.05)
        assert_closed(arena)
        with pytest.raises(PoolRestarted):
            client.alloc(1)


def test_reconnect_alone_retires_the_old_arena(pools: Pools) -> None:
    """reconnect() right after a restart (nothing else noticed it) still invalidates the old views."""
    pool = pools.start()
    with PoolClient(pool.url, name="eager", heartbeat=False) as client:
        arena = client.arena()
        pools.restart(pool)
        client.reconnect()
        assert_closed(arena)
        assert client.arena().epoch == client.epoch


def test_first_arena_after_an_unnoticed_restart_is_refused(pools: Pools) -> None:
    """Mapping the new pool's arena under the old pool's session would pair a dead session with live memory."""
    pool = pools.start()
    with PoolClient(pool.url, name="late", heartbeat=False) as client:
        pools.restart(pool)
        with pytest.raises(PoolRestarted):
            client.arena()
        client.reconnect()
        assert client.arena().epoch == client.epoch


def test_one_pool_restarting_leaves_another_pools_arena_alone(pools: Pools) -> None:
    first, second = pools.start(), pools.start()
    with PoolClient(first.url, name="a") as a, PoolClient(second.url, name="b") as b:
        arena_a, arena_b = a.arena(), b.arena()
        (block,) = b.alloc(1)
        arena_b.k(0)[block].fill_(5.0)
        pools.restart(first)
        with pytest.raises(PoolRestarted):
            a.alloc(1)
        assert_closed(arena_a)
        assert not arena_b.closed and bool((arena_b.k(0)[block] == 5.0).all())
        assert b.free([block]) == 1


def test_sigterm_answers_a_waiting_claim_and_stops_promptly(pools: Pools) -> None:
    """A claim can wait an hour; a stopping pool answers it (503, PoolUnavailable) instead of hanging on it."""
    pool = pools.start()
    errors: list[Exception] = []
    with PoolClient(pool.url, name="claimer", fast=False) as http_client, PoolClient(pool.url, name="fast") as fast:

        def claim(client: PoolClient) -> None:
            try:
                client.claim("never-parked", timeout_s=600)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=claim, args=(c,)) for c in (http_client, fast)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        assert pool.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert time.monotonic() - t0 < 5
        for t in threads:
            t.join(timeout=10)
        assert len(errors) == 2 and all(isinstance(e, PoolUnavailable) for e in errors), errors
    assert "Traceback" not in pool.output(), pool.output()


def test_a_heartbeat_in_flight_across_reconnect_does_not_poison_the_new_session(pools: Pools) -> None:
    """Regression: a beat for the old session answered 404 after reconnect() must not mark the new one lost.

    The beat is held (by wrapping the client's HTTP call) until reconnect() has opened the new session, which
    is the interleaving that, unordered, made the next call raise UnknownSession on a perfectly live session.
    """
    pool = pools.start()
    with PoolClient(pool.url, name="racer") as client:
        send = client.transport.fetch
        in_flight, reconnected = threading.Event(), threading.Event()

        def held_beats(route: Route, *args: Any, **kwargs: Any) -> Any:
            if route is HEARTBEAT and not reconnected.is_set():
                in_flight.set()
                reconnected.wait(10)
            return send(route, *args, **kwargs)

        client.transport.fetch = held_beats  # type: ignore[method-assign]
        pools.restart(pool)
        assert in_flight.wait(10), "no heartbeat was sent"
        client.reconnect()
        reconnected.set()
        time.sleep(LEASE_TTL_S)  # the held beat comes back 404 meanwhile, and later beats run normally
        assert client.alloc(1)
        assert client.session.lost is None
