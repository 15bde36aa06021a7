"""A client's session on its own, against a pool in the test process: opened, kept alive, found lost, found
restarted, closed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool.errors import InvalidRequest, LeaseLapsed, PoolRestarted, UnknownSession
from kvpool.protocol import SessionInfo
from kvpool.routes import HEARTBEAT
from kvpool.server.transports.local import LocalPool
from kvpool.session import Session
from kvpool.transport import Transport
from tests.conftest import SMALL_POOL, local_pool

LEASE_S = 2.0


@pytest.fixture(scope="module")
def pool_server() -> Iterator[LocalPool]:
    pool = local_pool(*SMALL_POOL, "--lease-ttl-s", str(LEASE_S))
    yield pool
    pool.stop()


@pytest.fixture
def transport(pool_server: LocalPool) -> Iterator[Transport]:
    t = Transport(pool_server.url, None, 10.0)
    yield t
    t.close()


def listed(pool: LocalPool, name: str) -> int:
    with pool.http() as http:
        return len(http.get("/sessions", params={"name": name}).json()["sessions"])


def test_a_session_opens_with_the_pool_s_epoch_and_lease_and_closes(pool_server: LocalPool, transport) -> None:
    restarts: list[None] = []
    s = Session(transport, "sess-a", "decode", None, on_restart=lambda: restarts.append(None))
    info = s.open(inbox=False)
    assert (s.session_id, s.epoch, s.lease_ttl_s) == (info.session_id, pool_server.stats()["epoch"], LEASE_S)
    assert s.lost is None and s.health().epoch == s.epoch and listed(pool_server, "sess-a") == 1
    assert s.guard(lambda: 42) == 42
    s.close()
    assert listed(pool_server, "sess-a") == 0 and restarts == []


def test_a_name_the_pool_would_refuse_is_refused_before_any_call(transport) -> None:
    with pytest.raises(InvalidRequest, match="cannot open a session"):
        Session(transport, "x" * 1000, "decode", None, on_restart=lambda: None).open(inbox=False)


def test_the_heartbeat_finds_a_session_the_pool_ended_and_every_call_then_fails(pool_server, transport) -> None:
    s = Session(transport, "sess-lost", "other", None, on_restart=lambda: None)
    s.open(inbox=False)
    beats: list[None] = []
    s.on_beat = lambda: beats.append(None)
    s.start_heartbeat()
    try:
        deadline = time.monotonic() + s.lease_ttl_s + 2.0  # a beat every lease / 3
        while not beats and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beats, "the heartbeat runs and says so after each beat the pool answered"
        with pool_server.http() as http:
            assert http.delete(f"/sessions/{s.session_id}").status_code == 200
        while s.lost is None and time.monotonic() < deadline + s.lease_ttl_s:
            time.sleep(0.05)
        assert isinstance(s.lost, UnknownSession)
        called: list[None] = []
        with pytest.raises(UnknownSession):
            s.guard(lambda: called.append(None))
        assert called == []  # a lost session makes no call
        s.open(inbox=False)  # reconnecting opens a new one
        assert s.lost is None and s.guard(lambda: "again") == "again"
    finally:
        s.close()
    assert not s._beat.is_alive()  # type: ignore[union-attr]


def test_a_pool_that_restarted_retires_the_session_and_what_the_client_kept(pool_server, transport) -> None:
    restarts: list[None] = []
    s = Session(transport, "sess-restart", "other", None, on_restart=lambda: restarts.append(None))
    s.open(inbox=False)
    s.epoch = "an-epoch-before"  # as if the pool had restarted since the session opened
    with pytest.raises(PoolRestarted, match="the pool restarted") as restarted:
        s.guard(lambda: transport.fetch(HEARTBEAT, session_id="no-such"))
    assert restarts == [None] and s.lost is restarted.value
    with pytest.raises(PoolRestarted):
        s.guard(lambda: None)
    s.epoch = pool_server.stats()["epoch"]
    s.close()


def test_an_unknown_session_in_the_same_epoch_stays_unknown(transport) -> None:
    s = Session(transport, "sess-same", "other", None, on_restart=lambda: None)
    s.open(inbox=False)
    try:
        with pytest.raises(UnknownSession):
            s.guard(lambda: transport.fetch(HEARTBEAT, session_id="no-such"))
        assert s.lost is None  # one refused call is no lost session
    finally:
        s.close()


class StubTransport:
    """Answers opens and heartbeats at once, each at the fake clock's time when it was sent (``then``)."""

    def __init__(self, clock: list[float], lease_s: float, answer_after_s: float = 0.0) -> None:
        self.clock, self.lease_s, self.answer_after_s = clock, lease_s, answer_after_s

    def fetch(self, route: object, req: object = None, wait_s: float = 0.0, session_id: object = None) -> SessionInfo:
        self.clock[0] += self.answer_after_s  # the reply comes this long after the send
        return SessionInfo(session_id="0123abcd-0123456789abcdef", lease_ttl_s=self.lease_s, epoch="e")


def stub_session(monkeypatch: pytest.MonkeyPatch, lease_s: float, answer_after_s: float = 0.0):
    clock = [100.0]
    monkeypatch.setattr("kvpool.session.time.monotonic", lambda: clock[0])
    t = StubTransport(clock, lease_s, answer_after_s)
    return Session(t, "s", "other", None, on_restart=lambda: None), clock  # type: ignore[arg-type]


def test_lapsed_is_proven_from_the_send_of_the_last_acknowledged_renewal(monkeypatch) -> None:
    s, clock = stub_session(monkeypatch, lease_s=10.0, answer_after_s=2.0)
    assert isinstance(s.lapsed(), LeaseLapsed)  # never opened: nothing proven
    s.open(inbox=False)  # sent at 100, answered at 102: proven until 100 + 10 - 1 (a tenth of the lease)
    assert s.proven_until == 109.0
    clock[0] = 109.0
    assert s.lapsed() is None
    clock[0] = 109.01
    err = s.lapsed()
    assert isinstance(err, LeaseLapsed) and "stop scheduling" in str(err)
    s.renewed(108.0)  # a heartbeat sent at 108 was acknowledged
    assert s.lapsed() is None and s.proven_until == 117.0
    s.renewed(104.0)  # a late answer to an older heartbeat proves nothing new
    assert s.proven_until == 117.0


def test_a_short_lease_keeps_a_margin_of_half_a_second_and_a_lost_session_is_lapsed(monkeypatch) -> None:
    s, _ = stub_session(monkeypatch, lease_s=1.0)
    s.open(inbox=False)
    assert s.proven_until == 100.5
    s.lost = UnknownSession("gone")
    assert s.lapsed() is s.lost


def test_a_heartbeat_that_stalls_leaves_the_lease_unproven(pool_server, transport) -> None:
    """The heartbeat thread cannot run (here: never started, as in a stopped process): no flag is set, and
    lapsed() still says so once the lease is past, from the clock alone."""
    s = Session(transport, "sess-stalled", "other", None, on_restart=lambda: None)
    s.open(inbox=False)
    try:
        time.sleep(LEASE_S - 0.5 + 0.1)  # the margin is 0.5 s for a 2 s lease
        assert isinstance(s.lapsed(), LeaseLapsed) and s.lost is None
    finally:
        s.close()
