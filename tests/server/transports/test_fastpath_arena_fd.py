"""The VMM arena's fd exchange on the fast channel, on the CPU: a memfd stands in for the exported allocation.

SCM_RIGHTS passes any fd the same way, so the hand-over, its refusals and the channel staying in step after it
are all tested here without a GPU; tests/gpu/test_vmm.py maps a real one.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.channel import FastConnection, frame
from kvpool.errors import InvalidRequest, Unauthorized, UnknownSession
from kvpool.protocol import AllocRequest, ArenaFdRequest, SessionCreate
from kvpool.routes import ALLOC, ARENA_FD
from kvpool.server.arenas import OwnedArena
from kvpool.server.config import PoolSettings
from kvpool.server.plane import ControlPlane
from kvpool.server.transports.fastpath import FastChannel
from kvpool.transport import Transport

SECRET = b"the arena's bytes, as the pool exported them"


class MemfdArena(OwnedArena):
    """Stands in for a VMM arena: what matters to the channel is the fd it exported."""

    backend = "cuda"
    handle_kind = "vmm"

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvpool-test-arena")
        os.write(self.fd, SECRET)
        self.nbytes = len(SECRET)
        self.handle = "vmm:0"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def vmm_plane(plane: ControlPlane) -> ControlPlane:
    plane.owned_arenas[0].close()
    plane.owned_arenas[0] = MemfdArena()
    return plane


def serve(plane: ControlPlane, tmp_path: Path, client: Callable[[str], Any]) -> Any:
    """Run ``client(path)`` (blocking socket code) in a thread while the channel serves."""

    async def go() -> Any:
        channel = FastChannel(plane, tmp_path / "kvpool.sock.fast", 0o600, 1 << 20)
        await channel.start()
        try:
            return await asyncio.to_thread(client, str(channel.path))
        finally:
            await channel.stop()

    return asyncio.run(go())


def ask(path: str, token: str | None, body: bytes, hello: bool = True) -> tuple[list[int], int, bytes, int | None]:
    conn = FastConnection(path, timeout_s=10)
    try:
        statuses = []
        if hello:
            statuses.append(conn.call(b"hello", json.dumps({"token": token}).encode())[0])
        status, reply, fd = conn.call_fd(b"arena_fd", body)
        return statuses, status, reply, fd
    finally:
        conn.close()


def request(session_id: str, device: int | None = None) -> bytes:
    return ArenaFdRequest(session_id=session_id, device=device).model_dump_json().encode()


def test_a_live_session_gets_the_arena_s_fd_and_the_channel_stays_in_step(vmm_plane, tmp_path):
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id

    def client(path: str) -> tuple[int, bytes, bytes, int]:
        conn = FastConnection(path, timeout_s=10)
        try:
            assert conn.call(b"hello", b'{"token": "s3cret"}')[0] == 200
            status, reply, fd = conn.call_fd(b"arena_fd", request(sid))
            assert fd is not None
            try:
                data = os.pread(fd, len(SECRET), 0)
            finally:
                os.close(fd)
            after, _ = conn.call(b"alloc", json.dumps({"session_id": sid, "num_blocks": 1}).encode())
            return status, reply, data, after
        finally:
            conn.close()

    status, reply, data, after = serve(vmm_plane, tmp_path, client)
    assert status == 200 and data == SECRET
    descriptor = vmm_plane.descriptor.model_dump(mode="json")
    assert json.loads(reply) == {"epoch": vmm_plane.epoch, "index": 0, "nbytes": len(SECRET), "descriptor": descriptor}
    assert after == 200 and vmm_plane.stats()["in_use"] == 1


def test_a_session_is_told_its_arena_goes_by_fd_only_when_it_does(vmm_plane, plane_without_fd):
    """So that PoolClient.arena() asks for the fd and the descriptor in one exchange, and only where there is one."""
    assert vmm_plane.open_session(SessionCreate(name="w", role="other")).arena_fd
    assert not plane_without_fd.open_session(SessionCreate(name="w", role="other")).arena_fd


@pytest.fixture
def plane_without_fd(tmp_path: Path) -> Iterator[ControlPlane]:
    p = ControlPlane(PoolSettings(backend="cpu", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                                  socket=tmp_path / "other.sock", port=0, shm_dir=tmp_path / "shm2"))  # fmt: skip
    p.start()
    yield p
    p.close()


def test_the_fd_goes_to_nobody_who_did_not_say_hello_with_the_token(vmm_plane, tmp_path):
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id
    no_hello = serve(vmm_plane, tmp_path, lambda p: ask(p, None, request(sid), hello=False))
    wrong = serve(vmm_plane, tmp_path, lambda p: ask(p, "wrong", request(sid)))
    for _, status, reply, fd in (no_hello, wrong):
        assert fd is None and status == 401 and json.loads(reply)["error"] == Unauthorized.__name__
    assert wrong[0] == [401]


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (request("00000000-0000000000000000"), 404, UnknownSession.__name__),
        (b'{"session_id": 5}', 422, "ValidationError"),
        (b"{", 422, "ValidationError"),
    ],
    ids=["unknown-session", "wrong-type", "not-json"],
)
def test_the_fd_goes_to_no_unknown_session_nor_a_bad_request(vmm_plane, tmp_path, body, status, error):
    statuses, got, reply, fd = serve(vmm_plane, tmp_path, lambda p: ask(p, "s3cret", body))
    assert statuses == [200] and fd is None
    assert got == status and json.loads(reply)["error"] == error


def test_a_device_the_pool_has_no_arena_on_is_refused(vmm_plane, tmp_path):
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id
    _, status, reply, fd = serve(vmm_plane, tmp_path, lambda p: ask(p, "s3cret", request(sid, device=3)))
    assert fd is None and status == 400 and "no arena on device 3" in json.loads(reply)["detail"]


def test_an_arena_not_shared_by_fd_says_how_it_is_shared(plane, tmp_path):
    sid = plane.open_session(SessionCreate(name="w", role="other")).session_id
    _, status, reply, fd = serve(plane, tmp_path, lambda p: ask(p, "s3cret", request(sid)))
    assert fd is None and status == 400
    body = json.loads(reply)
    assert body["error"] == InvalidRequest.__name__ and "shared by shm" in body["detail"]


def test_the_client_transport_fetches_the_fd_on_a_connection_of_its_own(vmm_plane, tmp_path):
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id

    def client(path: str) -> bytes:
        transport = Transport("http://127.0.0.1:9", "s3cret", 10)
        try:
            fd = transport.call_fd(ARENA_FD, ArenaFdRequest(session_id=sid), path)
            try:
                return os.pread(fd, len(SECRET), 0)
            finally:
                os.close(fd)
        finally:
            transport.close()

    assert serve(vmm_plane, tmp_path, client) == SECRET


def test_the_client_transport_raises_the_pool_s_refusal(vmm_plane, tmp_path):
    def client(path: str) -> None:
        transport = Transport("http://127.0.0.1:9", "wrong", 10)
        try:
            transport.call_fd(ARENA_FD, ArenaFdRequest(session_id="x"), path)
        finally:
            transport.close()

    with pytest.raises(Unauthorized):
        serve(vmm_plane, tmp_path, client)


class _Recording:
    """A socket whose writes are recorded."""

    def __init__(self, sock: Any, writes: list[bytes]) -> None:
        self._sock, self._writes = sock, writes

    def sendall(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def recording_transport(path: str, writes: list[bytes]) -> Transport:
    transport = Transport("http://127.0.0.1:9", "s3cret", 10)
    transport.fast_path = path

    def connect(where: str) -> FastConnection:
        conn = FastConnection(where, timeout_s=10)
        conn.sock = _Recording(conn.sock, writes)  # type: ignore[assignment]
        return conn

    transport._connect = connect  # type: ignore[method-assign]
    return transport


def test_a_first_fd_fetch_says_hello_in_the_same_write_then_the_connection_carries_the_calls(vmm_plane, tmp_path):
    """A worker's first arena costs one round trip on the fast channel, not a hello's and then the fd's."""
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id
    req = ArenaFdRequest(session_id=sid)
    writes: list[bytes] = []

    def client(path: str) -> tuple[bytes, int, int]:
        transport = recording_transport(path, writes)
        try:
            _, fd = transport.fetch_fd(ARENA_FD, req, path)
            try:
                data = os.pread(fd, len(SECRET), 0)
            finally:
                os.close(fd)
            alloc, _ = transport.call(ALLOC, AllocRequest(session_id=sid, num_blocks=1))
            return data, len(alloc.block_ids), len(transport._conns)
        finally:
            transport.close()

    assert serve(vmm_plane, tmp_path, client) == (SECRET, 1, 1)
    hello = frame(b"hello", b'{"token": "s3cret"}')
    assert writes[0] == hello + frame(b"arena_fd", req.model_dump_json().encode())
    assert len(writes) == 2 and writes[1][4:].startswith(b"alloc\n")  # no second hello


def test_a_request_refused_after_an_accepted_hello_keeps_the_connection(vmm_plane, tmp_path):
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id
    writes: list[bytes] = []

    def client(path: str) -> tuple[int, bytes]:
        transport = recording_transport(path, writes)
        try:
            with pytest.raises(UnknownSession):
                transport.fetch_fd(ARENA_FD, ArenaFdRequest(session_id="00000000-0000000000000000"), path)
            held = len(transport._conns)
            _, fd = transport.fetch_fd(ARENA_FD, ArenaFdRequest(session_id=sid), path)
            try:
                return held, os.pread(fd, len(SECRET), 0)
            finally:
                os.close(fd)
        finally:
            transport.close()

    assert serve(vmm_plane, tmp_path, client) == (1, SECRET)
    assert [w.count(b"hello\n") for w in writes] == [1, 0]  # the second fetch went over the same connection


def test_work_given_to_a_fetch_runs_once_its_request_is_written_and_a_failure_in_it_costs_only_the_connection(
    vmm_plane, tmp_path
):
    """A worker loads the CUDA driver while the pool answers for the fd (``meanwhile``), on a new connection and on
    a held one; work that raises closes the connection, whose answer is then not read, and the next fetch opens
    another."""
    sid = vmm_plane.open_session(SessionCreate(name="w", role="other")).session_id
    req = ArenaFdRequest(session_id=sid)
    writes: list[bytes] = []
    seen: list[int] = []

    def client(path: str) -> list[bytes]:
        transport = recording_transport(path, writes)
        got = []

        def meanwhile() -> None:
            seen.append(len(writes))

        def failing() -> None:
            raise RuntimeError("no driver")

        try:
            for work in (meanwhile, meanwhile, failing, meanwhile):
                try:
                    _, fd = transport.fetch_fd(ARENA_FD, req, path, work)
                except RuntimeError:
                    got.append(b"raised")
                    continue
                try:
                    got.append(os.pread(fd, len(SECRET), 0))
                finally:
                    os.close(fd)
            return got
        finally:
            transport.close()

    assert serve(vmm_plane, tmp_path, client) == [SECRET, SECRET, b"raised", SECRET]
    assert seen == [1, 2, 4]  # each after its own request's write
    assert [w.count(b"hello\n") for w in writes] == [1, 0, 0, 1]  # the failure's connection was not kept
