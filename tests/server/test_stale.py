"""Fenced ids over a real pool: a stale id is refused (409 StaleBlock, naming it) on every way a call can come,
and changes nothing; a replayed direct delivery is dropped; a worker that resumes after its lease expired is
refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool.client import PoolClient
from kvpool.devices import DeviceSession
from kvpool.errors import HandoffNotFound, HandoffRefused, StaleBlock, UnknownSession
from kvpool.ids import block_of, pack_ids
from kvpool.inbox import SEAL_BYTES, Outbox, decode_delivery, encode_delivery, seal_delivery
from tests.conftest import SMALL_POOL, LocalPool, local_pool
from tests.server.balance import books


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    server = local_pool(*SMALL_POOL)
    yield server
    server.stop()


def stats(client: PoolClient) -> dict[str, int]:
    return books(client.stats())


def recycled(client: PoolClient, n: int = 2) -> tuple[list[int], list[int]]:
    """Ids of ``client``'s that went stale (freed, then allocated to it again) and the ones it holds now."""
    old = client.alloc(n)
    client.free(old)
    new = client.alloc(n)  # a freed block is the first handed out again
    assert sorted(map(block_of, new)) == sorted(map(block_of, old)) and not set(old) & set(new)
    return old, new


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
@pytest.mark.parametrize("call", ["free", "commit", "handoff", "handoff-to"])
def test_a_stale_id_is_refused_and_changes_nothing(pool, fast, call):
    with PoolClient(pool.url, name=f"stale-{call}-{fast}", fast=fast) as w:
        old, new = recycled(w)
        before = stats(w)
        with pytest.raises(StaleBlock, match="stale") as refused:
            if call == "free":
                w.free(old)
            elif call == "commit":
                w.commit(old, list(range(8)))
            else:
                w.handoff(f"r-{call}-{fast}", old, 8, to=w.name if call == "handoff-to" else None)
        assert set(refused.value.stale) == set(old)
        assert stats(w) == before
        assert w.free(new) == 2


def test_the_refusal_names_the_stale_ids_in_json(pool):
    with PoolClient(pool.url, name="json") as w:
        old, new = recycled(w, 1)
        r = w.transport.http.post("/free", json={"session_id": w.session_id, "block_ids": old + new})
        assert r.status_code == 409
        body = r.json()
        assert body["error"] == "StaleBlock" and body["stale_ids"] == old and str(old[0]) in body["detail"]
        assert w.free(new) == 1


def test_a_worker_holding_arena_indices_is_fenced_too(pool):
    """DeviceSession gives a worker plain arena indices and fences them again on the way back: an index the worker
    let go of, now someone else's block, is refused rather than freeing the other worker's grant."""
    with PoolClient(pool.url, name="dev-a") as a, PoolClient(pool.url, name="dev-b") as b:
        dev = DeviceSession(a)
        local = dev.alloc(2)
        assert local == [block_of(i) for i in dev.fences.restore(local)]
        assert dev.free(local) == 2
        theirs = b.alloc(2)
        assert sorted(block_of(i) for i in theirs) == sorted(local)
        with pytest.raises(StaleBlock):
            dev.free(local)
        assert b.free(theirs) == 2


def test_a_replayed_direct_delivery_gives_the_consumer_nothing(pool):
    """Someone recorded the sealed datagram of a handoff and sends it again after its blocks were claimed, freed and
    handed to another request: the consumer's inbox drops it (its number is not newer), no claim returns its ids,
    and the ids themselves are stale at the pool."""
    with (
        PoolClient(pool.url, name="replay-consumer", inbox=True, spin_s=0.0) as d,
        PoolClient(pool.url, name="replay-producer") as p,
    ):
        assert d.direct.inbox is not None
        ids = p.alloc(2)
        p.handoff("r1", ids, 8, meta={"n": 1}, to=d.name)
        got = d.claim("r1", timeout_s=10)
        d.confirm()
        assert got.direct and got.block_ids == ids
        # the datagram the pool sent for r1, byte for byte (the first delivery to this session)
        unsealed = encode_delivery(d.epoch, "r1", pack_ids(ids), 8, b'{"n":1}', 1)
        recorded = unsealed[:-SEAL_BYTES] + seal_delivery(d.direct.inbox.key, unsealed)
        assert decode_delivery(memoryview(recorded), d.epoch.encode(), d.direct.inbox.key) is not None
        d.free(got.ids)
        again = p.alloc(2)  # the same blocks, under new generations
        assert sorted(map(block_of, again)) == sorted(map(block_of, ids))
        out = Outbox()
        try:
            assert out.send(d.direct.inbox.path, recorded)
            with pytest.raises(HandoffNotFound):
                d.claim(timeout_s=0.3)
            assert out.send(d.direct.inbox.path, recorded)
            with pytest.raises(HandoffNotFound):
                d.claim("r1", timeout_s=0.3)
        finally:
            out.close()
        with pytest.raises(StaleBlock):
            d.free(ids)
        p.handoff("r2", again, 8, to=d.name)  # a real delivery after the replays still comes straight through
        got = d.claim("r2", timeout_s=10)
        d.confirm()
        assert got.direct and got.block_ids == again
        assert d.free(got.ids) == 2


def test_a_stale_direct_handoff_is_refused_and_its_claim_told(pool):
    with (
        PoolClient(pool.url, name="stale-consumer", inbox=True, spin_s=0.0) as d,
        PoolClient(pool.url, name="stale-producer") as p,
    ):
        old, new = recycled(p)
        with pytest.raises(StaleBlock):
            p.handoff("r-stale", old, 8, to=d.name)
        with pytest.raises(HandoffRefused, match="StaleBlock"):
            d.claim("r-stale", timeout_s=5)
        assert p.free(new) == 2


def test_a_worker_that_resumes_after_its_lease_expired_is_refused():
    server = local_pool(*SMALL_POOL, "--lease-ttl-s", "0.5")
    try:
        with (
            # over TCP, where the pool cannot know the process: its blocks go to others at once, as the test needs
            # (over the Unix socket they would stay quarantined while this process lives: test_quarantine.py)
            PoolClient(server.tcp_url, name="paused", heartbeat=False) as paused,
            PoolClient(server.url, name="next") as other,
        ):
            ids = paused.alloc(3)
            deadline = time.monotonic() + 30
            while other.stats()["counters"]["sessions_expired"] < 1:  # the pool's sweep released it
                assert time.monotonic() < deadline, "the paused session never expired"
                time.sleep(0.05)
            taken = other.alloc(3)
            assert sorted(map(block_of, taken)) == sorted(map(block_of, ids))
            with pytest.raises(UnknownSession):
                paused.free(ids)
            paused.reconnect()
            before = stats(other)
            for call in (lambda: paused.free(ids), lambda: paused.commit(ids, list(range(12))),
                         lambda: paused.handoff("late", ids, 12, to="next")):  # fmt: skip
                with pytest.raises(StaleBlock) as refused:
                    call()
                assert set(refused.value.stale) == set(ids)
            assert stats(other) == before
            assert other.free(taken) == 3
    finally:
        server.stop()
