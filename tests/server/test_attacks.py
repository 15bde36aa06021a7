"""What an attacker on the same node tries, against a real pool: each test here is one attack and what must hold.

The attackers: a process with no session and no token (run as a second local user in the socket's group where
the test runs as root, which can make one; as this user otherwise), a buggy or malicious client, and another
user who owns the socket directory a client would use by default.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool import cli
from kvpool.channel import FastConnection, frame
from kvpool.client import PoolClient
from kvpool.errors import HandoffNotFound, LimitExceeded, UntrustedSocket
from kvpool.inbox import encode_delivery
from tests.conftest import SMALL_POOL, PoolProcess, start_pool
from tests.server.books import assert_balanced

OTHER_UID = 65534  # nobody: a second local user, made a member of the pool's socket group for the attack
TOKEN = "attack-tests-token"
IS_ROOT = os.geteuid() == 0


def wait_until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the pool did not get there in time"
        time.sleep(0.01)


def as_stranger(fn: Callable[[], Any], group: int) -> Any:
    """Run ``fn`` as another local user who is in the pool's socket group (as this user where not root).

    A forked child that drops its privileges: the other user may not be able to read this Python at all, and
    ``fn`` only needs the sockets. Returns what ``fn`` returns (JSON).
    """
    if not IS_ROOT:
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([group])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.write(write, json.dumps(fn()).encode())
            code = 0
        except BaseException as exc:  # reported to the parent through the pipe
            os.write(write, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    result = json.loads(out)
    assert not (isinstance(result, dict) and "error" in result), result
    return result


def raw_health(path: str) -> dict[str, Any]:
    """GET /health over the Unix socket with no client library: what any member of the socket group can do."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: kvpool\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return dict(json.loads(data.partition(b"\r\n\r\n")[2]))


@pytest.fixture
def group_pool() -> Iterator[PoolProcess]:
    """A pool with a token, its socket directory open to its group (as a deployment shares it with workers)."""
    pool = start_pool(*SMALL_POOL, "--lease-ttl-s", "5", env={"KVPOOL_TOKEN": TOKEN})
    pool.socket.parent.chmod(0o750)
    yield pool
    pool.stop()


def test_a_forged_delivery_never_reaches_a_claim(group_pool: PoolProcess) -> None:
    """Another user in the socket's group, with no session and no token, reads the epoch from the open /health,
    finds the consumer's inbox in the socket directory, and sends it block ids of its choosing, for a request
    the consumer will claim and for one whose real handoff comes later: the consumer takes neither."""
    pool = group_pool
    with (
        PoolClient(pool.url, name="decode-0", token=TOKEN, inbox=True, spin_s=0.0) as consumer,
        PoolClient(pool.url, name="prefill-0", token=TOKEN) as producer,
    ):
        real = producer.alloc(3)
        forged = [60, 61, 62]
        sock_dir = str(pool.socket.parent)

        def forge() -> dict[str, Any]:
            epoch = raw_health(str(pool.socket))["epoch"]
            inboxes = glob.glob(os.path.join(sock_dir, "inbox-*.sock"))
            out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            ids = memoryview(array("q", forged)).cast("B")
            sent = 0
            for path in inboxes:
                for rid in ("req-never-parked", "req-victim"):
                    out.sendto(encode_delivery(epoch, rid, ids, 12, b"{}", 1 << 62), path)
                    sent += 1
            out.close()
            return {"sent": sent, "uid": os.getuid()}

        done = as_stranger(forge, group=pool.socket.parent.stat().st_gid)
        assert done["sent"] == 2, "the attacker must reach the inbox for this test to mean anything"
        assert done["uid"] == (OTHER_UID if IS_ROOT else os.getuid())
        with pytest.raises(HandoffNotFound):
            consumer.claim("req-never-parked", timeout_s=0.5)
        producer.handoff("req-victim", real, 12, to="decode-0")
        got = consumer.claim("req-victim", timeout_s=10)
        consumer.confirm()
        assert got.block_ids == real
        assert consumer.free(got.ids) == 3
    s = pool.stats(TOKEN)
    assert (s["in_use"], s["handoffs"]) == (0, 0)
    assert_balanced(s)


def test_no_one_without_a_live_session_can_refuse_anothers_handoff(pool_server: PoolProcess) -> None:
    """A made-up session id "refuses" a request before its producer parks it: the consumer's claim must still get
    the real handoff, and its blocks must come back."""
    with (
        PoolClient(pool_server.url, name="decode-0", inbox=True) as consumer,
        PoolClient(pool_server.url, name="prefill-0") as producer,
        pool_server.http() as http,
    ):
        fake = {"session_id": "f" * 8 + "-0123456789abcdef", "request_id": "req-victim", "block_ids": [],
                "num_tokens": 0, "to": "decode-0"}  # fmt: skip
        assert http.post("/handoff", json=fake).status_code == 404
        conn = FastConnection(f"{pool_server.socket}.fast")
        assert conn.call(b"hello", b"{}")[0] == 200
        assert conn.call(b"handoff", json.dumps({**fake, "num_tokens": "x"}).encode())[0] == 422  # refused unread
        conn.close()

        got: dict[str, Any] = {}

        def claim() -> None:
            try:
                got["claim"] = consumer.claim("req-victim", timeout_s=20)
                consumer.confirm()
            except Exception as exc:
                got["error"] = exc

        waiter = threading.Thread(target=claim)
        waiter.start()
        wait_until(lambda: pool_server.stats().get("claims_waiting") == 1 or not waiter.is_alive())
        ids = producer.alloc(2)
        producer.handoff("req-victim", ids, 8, to="decode-0")
        waiter.join(30)
        assert "error" not in got, got
        assert got["claim"].block_ids == ids
        consumer.free(got["claim"].ids)
    s = pool_server.stats()
    assert (s["in_use"], s["handoffs"]) == (0, 0)


@pytest.mark.slow
def test_sessions_expiring_together_never_stall_the_others(tmp_path: Path) -> None:
    """Thousands of idle sessions expire in one sweep while tens of thousands of handoffs are parked: the sweep
    must cost what expired, or the pool's one event loop stalls past the lease and expires everyone else."""
    sessions, producers, per_producer = 3000, 20, 2000
    pool = start_pool(
        *SMALL_POOL, "--lease-ttl-s", "2", "--max-sessions", str(sessions + 100), "--handoff-ttl-s", "3600"
    )
    try:
        with PoolClient(pool.url, name="victim") as victim, pool.http() as http:
            conn = hello(pool)
            for i in range(producers):  # parked for anyone, for an hour: they outlive their producers
                r = http.post("/sessions", json={"name": f"p{i}"})
                sid = r.json()["session_id"]
                for j in range(per_producer):
                    body = {"session_id": sid, "request_id": f"h-{i}-{j}", "block_ids": [], "num_tokens": 0}
                    assert conn.call(b"handoff", json.dumps(body).encode())[0] == 200
            conn.close()
            assert pool.stats()["handoffs"] == producers * per_producer
            idle: list[str] = []
            for i in range(sessions):
                r = http.post("/sessions", json={"name": f"idle-{i}"})
                assert r.status_code == 200, r.text
                idle.append(r.json()["session_id"])
                if len(idle) % 300 == 0:
                    beat(pool, idle)  # keep them all alive while the rest open, so that they end together
            beat(pool, idle)  # the last sign of life of every idle session: they all expire in one sweep
            expired = producers + sessions
            wait_until(lambda: pool.stats()["counters"]["sessions_expired"] >= expired, timeout_s=60)
            victim.alloc(1)  # still alive: its heartbeats got through while the others expired
            s = pool.stats()
            assert (s["counters"]["sessions_expired"], s["sessions"]) == (expired, 1)
    finally:
        pool.stop()


def beat(pool: PoolProcess, session_ids: list[str]) -> None:
    conn = hello(pool)
    for sid in session_ids:
        assert conn.call(b"heartbeat", json.dumps({"session_id": sid}).encode())[0] == 200
    conn.close()


def hello(pool: PoolProcess, token: str | None = None) -> FastConnection:
    conn = FastConnection(f"{pool.socket}.fast")
    status, body = conn.call(b"hello", json.dumps({"token": token} if token else {}).encode())
    assert status == 200, body
    return conn


@pytest.mark.slow
def test_per_client_bounds_are_settings_and_say_which(tmp_path: Path) -> None:
    """Sessions, parked handoffs, meta size and waiting claims are bounded; a call past a bound is a 429 that
    names the setting, and changes nothing."""
    pool = start_pool(*SMALL_POOL, "--max-sessions", "3", "--max-handoffs-per-session", "2", "--max-meta-bytes",
                      "64", "--max-claims-per-session", "1")  # fmt: skip
    try:
        with PoolClient(pool.url, name="a") as a, PoolClient(pool.url, name="b", fast=False) as b:
            http = pool.http()
            assert http.post("/sessions", json={"name": "c"}).status_code == 200
            r = http.post("/sessions", json={"name": "d"})
            assert r.status_code == 429 and "KVPOOL_MAX_SESSIONS" in r.json()["detail"], r.text
            with pytest.raises(LimitExceeded, match="max-meta-bytes"):
                a.handoff("big", [], 0, meta={"x": "y" * 100})
            a.handoff("h1", [], 0)
            a.handoff("h2", [], 0)
            before = pool.stats()
            with pytest.raises(LimitExceeded, match="max-handoffs-per-session"):
                a.handoff("h3", a.alloc(1), 1)
            assert pool.stats()["handoffs"] == before["handoffs"] == 2

            def wait_in_vain() -> None:
                with pytest.raises(HandoffNotFound):
                    b.claim("x", timeout_s=3.0)

            waiting = threading.Thread(target=wait_in_vain)
            waiting.start()
            wait_until(lambda: pool.stats()["claims_waiting"] == 1)
            with pytest.raises(LimitExceeded, match="max-claims-per-session"):
                b.claim("y", timeout_s=3.0)
            waiting.join()
            metrics = http.get("/metrics").text
            http.close()
        s = pool.stats()
        assert_balanced(s)
        assert s["limits_exceeded"] == {"max_sessions": 1, "max_meta_bytes": 1, "max_handoffs_per_session": 1,
                                        "max_claims_per_session": 1}  # fmt: skip
        assert 'kvpool_limits_exceeded_total{limit="max_sessions"} 1.0' in metrics
    finally:
        pool.stop()


@pytest.mark.slow
def test_a_stranger_holds_no_memory_and_no_connection_for_long_before_hello(tmp_path: Path) -> None:
    pool = start_pool(*SMALL_POOL, "--hello-timeout-s", "0.5", env={"KVPOOL_TOKEN": TOKEN})
    try:
        big = FastConnection(f"{pool.socket}.fast")
        big.sock.sendall((1 << 20).to_bytes(4, "little"))  # a megabyte announced before any hello: refused
        status, body = big.receive()
        assert status == 413 and b"before hello" in body
        big.close()
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(f"{pool.socket}.fast")
        idle.sendall(b"\x10\x00")  # half a header, then nothing: the pool hangs up
        idle.settimeout(30)
        assert idle.recv(1) == b""
        idle.close()
        hello(pool, TOKEN).close()  # a client that says hello is served as before
    finally:
        pool.stop()


@pytest.mark.parametrize("transport", ["http", "fast"])
def test_a_claim_whose_caller_left_takes_nothing(pool_server: PoolProcess, transport: str) -> None:
    """A claim waits in the pool; its caller goes away (an HTTP client's time-out, a closed connection): the next
    handoff must stay parked for whoever claims next, not go into the session with nobody to learn its ids."""
    with PoolClient(pool_server.url, name="owner", fast=False) as owner, PoolClient(pool_server.url, name="p") as p:
        body = {"session_id": owner.session_id, "request_id": None, "timeout_s": 30.0}
        if transport == "http":
            with pool_server.http(timeout_s=0.3) as http, pytest.raises(httpx.TimeoutException):
                http.post("/claim", json=body)
        else:
            conn = hello(pool_server)
            conn.sock.sendall(frame(b"claim", json.dumps(body).encode()))
            wait_until(lambda: pool_server.stats().get("claims_waiting", 1) == 1)
            conn.close()
        wait_until(lambda: pool_server.stats().get("claims_waiting", 0) == 0)
        ids = p.alloc(2)
        p.handoff("after", ids, 8)
        assert pool_server.stats()["handoffs"] == 1
        got = owner.claim(None, timeout_s=5)
        assert (got.request_id, got.block_ids) == ("after", ids)
        owner.free(got.ids)
    s = pool_server.stats()
    assert (s["in_use"], s["handoffs"]) == (0, 0)


def test_an_interrupted_call_never_hands_its_answer_to_the_next(pool_server: PoolProcess) -> None:
    """A signal handler raises while a fast-channel claim waits: the next call on that thread gets its own
    answer, not the claim's, and the interrupted claim takes nothing."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    with PoolClient(pool_server.url, name="c") as c, PoolClient(pool_server.url, name="p") as p:
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Interrupted):
                c.claim(None, timeout_s=2.0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        mine = c.alloc(1)
        assert len(mine) == 1
        wait_until(lambda: pool_server.stats().get("claims_waiting", 0) == 0)
        ids = p.alloc(2)
        p.handoff("next", ids, 8)
        got = c.claim(None, timeout_s=5)
        assert (got.request_id, got.block_ids) == ("next", ids)
        assert c.free([*mine, *got.block_ids]) == 3
    assert pool_server.stats()["in_use"] == 0


# -- a squatted socket directory ---------------------------------------------------------------------------


class FakePool:
    """A socket someone else put where a client looks for the pool: it records what clients send it."""

    def __init__(self, path: Path) -> None:
        self.received = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.received += conn.recv(65536)
                    body = b'{"status": "ok", "epoch": "fake"}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (len(body), body))  # fmt: skip
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def squatted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, FakePool]]:
    """The default socket directory, created first by another user, with a fake pool in it."""
    tmp = Path(tempfile.mkdtemp(prefix="kvp-squat-"))
    tmp.chmod(0o1777)  # a shared /tmp: anyone may create entries, only their owner may replace them
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("KVPOOL_URL", raising=False)
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
    directory = tmp / f"kvpool-{os.getuid()}"
    directory.mkdir(mode=0o755)
    fake = FakePool(directory / "kvpool.sock")
    os.chown(directory, OTHER_UID, OTHER_UID)
    os.chown(directory / "kvpool.sock", OTHER_UID, OTHER_UID)
    yield directory, fake
    fake.close()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT, reason="making files of another user needs root")
def test_a_squatted_default_socket_directory_gets_no_token(squatted: tuple[Path, FakePool]) -> None:
    _, fake = squatted
    with pytest.raises(UntrustedSocket, match=f"belongs to uid {OTHER_UID}"):
        PoolClient(name="victim")
    assert cli.main(["health"]) == 1
    assert cli.main(["info", "--token", TOKEN]) == 1
    assert fake.received == b""


@pytest.mark.skipif(not IS_ROOT, reason="making files of another user needs root")
def test_a_planted_link_to_another_users_directory_gets_no_token(squatted: tuple[Path, FakePool]) -> None:
    directory, fake = squatted
    link = directory.parent / f"kvpool-{os.getuid()}-link"
    link.symlink_to(directory)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedSocket, match=str(OTHER_UID)):
        PoolClient(f"unix://{link}/kvpool.sock", name="victim")
    assert fake.received == b""


def test_a_socket_of_ours_in_a_private_directory_passes(pool_server: PoolProcess) -> None:
    assert stat.S_IMODE(pool_server.socket.parent.stat().st_mode) & 0o022 == 0
    with PoolClient(pool_server.url, name="fine") as ok:
        assert ok.health().status == "ok"
