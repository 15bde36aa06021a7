"""The fast channel in process: its framing, hello, errors and packed ids, against a plane on a CPU arena."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kvpool.channel import HEADER, decode, frame
from kvpool.ids import unpack_ids
from kvpool.protocol import AllocRequest, AllocResponse, SessionCreate
from kvpool.server.plane import ControlPlane
from kvpool.server.transports.fastpath import FastChannel


async def exchange(path: Path, *frames: bytes) -> list[tuple[int, bytes]]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    replies = []
    try:
        for f in frames:
            writer.write(f)
            await writer.drain()
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            status, _, body = (await reader.readexactly(size)).partition(b"\n")
            replies.append((int(status), body))
    finally:
        writer.close()
    return replies


def run(plane: ControlPlane, tmp_path: Path, *frames: bytes, max_frame: int = 1 << 20) -> list[tuple[int, bytes]]:
    async def go() -> list[tuple[int, bytes]]:
        channel = FastChannel(plane, tmp_path / "kvpool.sock.fast", 0o600, max_frame)
        await channel.start()
        try:
            return await exchange(channel.path, *frames)
        finally:
            await channel.stop()

    return asyncio.run(go())


def hello(token: str | None = "s3cret") -> bytes:
    return frame(b"hello", json.dumps({"token": token} if token else {}).encode())


def test_calls_before_hello_or_with_a_wrong_token_are_refused(plane: ControlPlane, tmp_path: Path) -> None:
    sid = plane.open_session(SessionCreate(name="w", role="other")).session_id
    alloc = frame(b"alloc", json.dumps({"session_id": sid, "num_blocks": 1}).encode())
    ((status, body),) = run(plane, tmp_path, alloc)
    assert status == 401 and json.loads(body)["error"] == "Unauthorized"
    (status, _), (again, _) = run(plane, tmp_path, hello("wrong"), alloc)
    assert (status, again) == (401, 401)
    assert plane.stats()["in_use"] == 0


def test_ids_come_back_packed_and_errors_in_the_pool_s_shape(plane: ControlPlane, tmp_path: Path) -> None:
    sid = plane.open_session(SessionCreate(name="w", role="other")).session_id
    replies = run(
        plane,
        tmp_path,
        hello(),
        frame(b"alloc", json.dumps({"session_id": sid, "num_blocks": 3}).encode()),
        frame(b"alloc", json.dumps({"session_id": sid, "num_blocks": 99}).encode()),
        frame(b"alloc", b'{"session_id": 5}'),
        frame(b"nope", b"{}"),
    )
    (ok, _), (status, body), (exhausted, why), (invalid, errors), (unknown, _) = replies
    assert (ok, status) == (200, 200)
    resp, ids = decode(AllocResponse, body)
    assert ids is not None and resp.block_ids == unpack_ids(ids.tobytes()).tolist() and len(resp.block_ids) == 3
    assert (exhausted, json.loads(why)["error"]) == (507, "PoolExhausted")
    assert invalid == 422 and json.loads(errors)["error"] == "ValidationError"
    assert unknown >= 400
    assert plane.stats()["in_use"] == 3


def test_a_frame_over_the_limit_closes_the_connection_with_413(plane: ControlPlane, tmp_path: Path) -> None:
    (ok, _), (status, body) = run(plane, tmp_path, hello(), HEADER.pack(4096) + b"x" * 16, max_frame=1024)
    assert ok == 200
    assert status == 413 and json.loads(body)["error"] == "PayloadTooLarge"
    assert "--max-body-bytes" in json.loads(body)["detail"]


def test_before_hello_only_a_small_frame_is_read(plane: ControlPlane, tmp_path: Path) -> None:
    ((status, body),) = run(plane, tmp_path, HEADER.pack(1 << 20) + b"x" * 16)
    assert status == 413 and "before hello" in json.loads(body)["detail"]


def test_a_handoff_whose_addressee_ended_is_refused_to_anyone_over_the_channel(
    plane: ControlPlane, tmp_path: Path
) -> None:
    """Addressed to decode-0, which ends before it claims: a session opened under its name next takes nothing, by
    ``claim`` of the oldest or by ``accept`` (the direct path's claim), and the producer's ``claim`` says why."""
    p = plane.open_session(SessionCreate(name="prefill", role="prefill")).session_id
    d = plane.open_session(SessionCreate(name="decode-0", role="decode")).session_id
    ids = plane.alloc(AllocRequest(session_id=p, num_blocks=2)).block_ids
    body = {"session_id": p, "request_id": "r", "block_ids": ids, "num_tokens": 5, "to": "decode-0"}
    (_, (parked, _)) = run(plane, tmp_path, hello(), frame(b"handoff", json.dumps(body).encode()))
    assert parked == 200 and plane.stats()["handoffs"] == 1
    plane.close_session(d)
    again = plane.open_session(SessionCreate(name="decode-0", role="decode")).session_id

    def claim(op: bytes, sid: str, request_id: str | None) -> bytes:
        return frame(op, json.dumps({"session_id": sid, "request_id": request_id, "timeout_s": 0}).encode())

    replies = run(
        plane, tmp_path, hello(), claim(b"claim", again, None), claim(b"accept", again, "r"), claim(b"claim", p, "r")
    )
    (_, (oldest, _), (accept, why), (asked, told)) = replies
    assert oldest == 404
    assert accept == 409 and json.loads(why)["error"] == "HandoffRefused"
    assert "session 'decode-0', ended before it claimed it" in json.loads(why)["detail"]
    assert asked == 409 and json.loads(told)["error"] == "HandoffRefused"
    s = plane.stats()
    assert (s["in_use"], s["handoffs"], s["counters"]["handoffs_orphaned"]) == (0, 0, 1)
