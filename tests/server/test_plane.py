"""The control plane in process: every handler on the real books over a small CPU arena, no server around it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.errors import HandoffNotFound, InvalidRequest, NotOwner, PoolExhausted, PoolUnavailable, UnknownSession
from kvpool.protocol import (
    AllocRequest,
    ClaimRequest,
    CommitRequest,
    FreeRequest,
    HandoffRequest,
    LookupRequest,
    SessionCreate,
)
from kvpool.server.config import PoolSettings
from kvpool.server.plane import ControlPlane

BLOCK = 4


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    settings = PoolSettings(
        backend="cpu", num_blocks=16, block_size=BLOCK, num_layers=1, num_kv_heads=1, head_dim=8,
        socket=tmp_path / "kvpool.sock", port=0, shm_dir=tmp_path / "shm",
    )  # fmt: skip
    p = ControlPlane(settings)
    p.start()
    yield p
    p.close()


def balanced(plane: ControlPlane) -> bool:
    s = plane.stats()
    return s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]


def session(plane: ControlPlane, name: str = "w") -> str:
    return plane.open_session(SessionCreate(name=name, role="other")).session_id


def test_a_plane_not_started_says_why(tmp_path: Path) -> None:
    p = ControlPlane(PoolSettings(backend="cpu", socket=tmp_path / "s.sock", port=0))
    with pytest.raises(PoolUnavailable, match="not ready"):
        p.alloc(AllocRequest(session_id="x", num_blocks=1))


def test_alloc_commit_free_lookup_on_the_books(plane: ControlPlane) -> None:
    a, b = session(plane, "a"), session(plane, "b")
    ids = plane.alloc(AllocRequest(session_id=a, num_blocks=2)).block_ids
    tokens = list(range(2 * BLOCK))
    assert plane.commit(CommitRequest(session_id=a, block_ids=ids, token_ids=tokens)).committed == 2
    assert plane.free(FreeRequest(session_id=a, block_ids=ids)).freed == 2
    hit = plane.lookup(LookupRequest(session_id=b, token_ids=[*tokens, 99]))
    assert (hit.block_ids, hit.num_tokens) == (ids, 2 * BLOCK)
    assert plane.stats()["in_use"] == 2 and balanced(plane)
    assert plane.close_session(b) == {"released": 2}
    assert plane.stats()["cached"] == 2 and balanced(plane)


def test_packed_tokens_and_token_ids_name_the_same_chain(plane: ControlPlane) -> None:
    """What one client committed as a JSON list another finds with its tokens packed, and the other way round."""
    from kvpool.protocol import LookupItem, LookupManyRequest
    from kvpool.tokens import pack_tokens

    a, b = session(plane, "a"), session(plane, "b")
    listed, packed = list(range(2 * BLOCK)), list(range(100, 100 + 2 * BLOCK))
    ids = plane.alloc(AllocRequest(session_id=a, num_blocks=4)).block_ids
    plane.commit(CommitRequest(session_id=a, block_ids=ids[:2], token_ids=listed))
    plane.commit(CommitRequest(session_id=a, block_ids=ids[2:], tokens=pack_tokens(packed)))
    hit = plane.lookup(LookupRequest(session_id=b, tokens=pack_tokens([*listed, 7])))
    assert (hit.block_ids, hit.num_tokens) == (ids[:2], 2 * BLOCK)
    hits = plane.lookup_many(LookupManyRequest(session_id=b, lookups=[
        LookupItem(token_ids=packed), LookupItem(tokens=pack_tokens(listed[:BLOCK]))]))  # fmt: skip
    assert [(h.block_ids, h.num_tokens) for h in hits.hits] == [(ids[2:], 2 * BLOCK), (ids[:1], BLOCK)]
    assert balanced(plane)


def test_refusals_change_nothing(plane: ControlPlane) -> None:
    a, b = session(plane, "a"), session(plane, "b")
    ids = plane.alloc(AllocRequest(session_id=a, num_blocks=3)).block_ids
    before = plane.stats()
    with pytest.raises(NotOwner):
        plane.free(FreeRequest(session_id=b, block_ids=ids))
    with pytest.raises(PoolExhausted):
        plane.alloc(AllocRequest(session_id=b, num_blocks=14))
    with pytest.raises(UnknownSession):
        plane.alloc(AllocRequest(session_id="gone", num_blocks=1))
    with pytest.raises(InvalidRequest):
        plane.alloc(AllocRequest(session_id=a, num_blocks=1, device=7))
    after = plane.stats()
    assert {k: after[k] for k in ("free", "in_use", "cached")} == {k: before[k] for k in ("free", "in_use", "cached")}


def test_a_claim_waits_for_its_handoff_and_moves_the_refs(plane: ControlPlane) -> None:
    prod, cons = session(plane, "prefill"), session(plane, "decode")
    ids = plane.alloc(AllocRequest(session_id=prod, num_blocks=2)).block_ids

    async def flow() -> list[int]:
        waiting = asyncio.ensure_future(plane.claim(ClaimRequest(session_id=cons, request_id="r1", timeout_s=5)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        plane.handoff(HandoffRequest(session_id=prod, request_id="r1", block_ids=ids, num_tokens=7, meta={"t": 1}))
        got = await waiting
        assert (got.num_tokens, got.meta) == (7, {"t": 1})
        return got.block_ids

    assert asyncio.run(flow()) == ids
    with pytest.raises(NotOwner):  # the producer's refs moved with the handoff
        plane.free(FreeRequest(session_id=prod, block_ids=ids))
    assert plane.free(FreeRequest(session_id=cons, block_ids=ids)).freed == 2
    assert plane.stats()["free"] == 16


def test_a_claim_times_out_with_404_and_stopping_answers_waiters(plane: ControlPlane) -> None:
    cons = session(plane)

    async def flow() -> None:
        with pytest.raises(HandoffNotFound, match=r"within 0\.01s"):
            await plane.claim(ClaimRequest(session_id=cons, request_id="never", timeout_s=0.01))
        waiting = asyncio.ensure_future(plane.claim(ClaimRequest(session_id=cons, request_id="x", timeout_s=60)))
        await asyncio.sleep(0.01)
        plane.stop_waiting()
        with pytest.raises(PoolUnavailable):
            await waiting

    asyncio.run(flow())


def test_metrics_read_the_same_snapshot_as_stats(plane: ControlPlane) -> None:
    from prometheus_client import generate_latest

    from kvpool.server.events.metrics import registry_for

    a = session(plane)
    plane.alloc(AllocRequest(session_id=a, num_blocks=5))
    text = generate_latest(registry_for(plane.stats)).decode()
    assert 'kvpool_blocks{state="in_use"} 5.0' in text
    assert 'kvpool_blocks{state="free"} 11.0' in text


def test_health_answers_are_made_once_for_each_state(plane: ControlPlane) -> None:
    """What ``GET /health`` answers at the door (server/transports/gates.py) is what its route said: 503 starting,
    then 200."""
    status, body = plane.health()
    assert (status, json.loads(body)) == (200, {"status": "ok", "epoch": plane.epoch})
    assert plane.health()[1] is body
    starting = ControlPlane(plane.settings)
    assert starting.health() == (503, b'{"status":"starting","epoch":"%s"}' % starting.epoch.encode())
