"""What an attacker on the same node tries, against a real pool: each test here is one attack and what must hold.

The attackers: a process with no session and no token (run as a second local user in the socket's group where
the test runs as root, which can make one; as this user otherwise), a buggy or malicious client, and another
user who owns the socket directory a client would use by default.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import resource
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
from kvpool.channel import HEADER, FastConnection, decode, frame
from kvpool.client import PoolClient, http_client
from kvpool.errors import (
    HandoffNotFound,
    HandoffRefused,
    LimitExceeded,
    NameTaken,
    NotOwner,
    PayloadTooLarge,
    UntrustedSocket,
)
from kvpool.inbox import encode_delivery
from kvpool.protocol import AllocResponse
from tests.conftest import SMALL_POOL, LocalPool, PoolProcess, start_pool
from tests.server.balance import assert_balanced

OTHER_UID = 65534  # nobody: a second local user, made a member of the pool's socket group for the attack
TOKEN = "attack-tests-token"
HEADER_SIZE = HEADER.size
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


@pytest.mark.slow
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


def test_a_token_holder_gets_nothing_addressed_to_a_consumer_that_restarts(pool_server: LocalPool) -> None:
    """A request addressed to decode-0 (and delivered to its inbox) while decode-0 goes down before it claims: no
    other session gets it, by its id or as the oldest, the one opened under decode-0's name next included. decode-0
    held its name with a key, so while it is down nobody else can even open the name."""
    key = "decode-0's name key, kept across its restarts"
    with (
        PoolClient(pool_server.url, name="prefill-0") as producer,
        PoolClient(pool_server.url, name="stranger") as stranger,
    ):
        consumer = PoolClient(pool_server.url, name="decode-0", inbox=True, name_key=key)
        producer.handoff("req-victim", producer.alloc(2), 8, to="decode-0")
        with pytest.raises(NotOwner):
            stranger.claim("req-victim", timeout_s=0)
        consumer.close()  # its worker restarts
        with pytest.raises(HandoffRefused, match="ended before it claimed it"):
            stranger.claim("req-victim", timeout_s=0)
        with pytest.raises(HandoffNotFound):
            stranger.claim(timeout_s=0.1)
        with pytest.raises(NameTaken):
            PoolClient(pool_server.url, name="decode-0", inbox=True)
        back = PoolClient(pool_server.url, name="decode-0", inbox=True, name_key=key)
        with back, pytest.raises(HandoffNotFound):
            back.claim(timeout_s=0.1)
    s = pool_server.stats()
    assert (s["in_use"], s["handoffs"], s["counters"]["handoffs_orphaned"]) == (0, 0, 1)
    assert_balanced(s)


def test_no_one_without_a_live_session_can_refuse_anothers_handoff(pool_server: LocalPool) -> None:
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
    blocks = str(producers * per_producer + 64)  # one block a handoff (of 1 KiB each)
    pool = start_pool(
        *SMALL_POOL, "--num-blocks", blocks, "--lease-ttl-s", "2", "--max-sessions", str(sessions + 100),
        "--handoff-ttl-s", "3600", "--max-sessions-per-peer", str(sessions + 100),
        "--max-handoffs-per-peer", str(producers * per_producer),
    )  # fmt: skip  # one peer (loopback TCP) opens them all: its share is not what this tests
    try:
        with PoolClient(pool.url, name="victim") as victim, pool.http() as http:
            conn = hello(pool)
            for i in range(producers):  # parked for anyone, for an hour: they outlive their producers
                r = http.post("/sessions", json={"name": f"p{i}"})
                sid = r.json()["session_id"]
                status, reply = conn.call(
                    b"alloc", json.dumps({"session_id": sid, "num_blocks": per_producer}).encode()
                )
                assert status == 200, reply
                ids = decode(AllocResponse, reply)[0].block_ids
                for j, block in enumerate(ids):
                    body = {"session_id": sid, "request_id": f"h-{i}-{j}", "block_ids": [block], "num_tokens": 0}
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
            ids = a.alloc(3)
            with pytest.raises(PayloadTooLarge, match="max-meta-bytes"):  # no wait would make it fit
                a.handoff("big", ids[:1], 0, meta={"x": "y" * 100})
            a.handoff("h1", ids[:1], 0)
            a.handoff("h2", ids[1:2], 0)
            before = pool.stats()
            with pytest.raises(LimitExceeded, match="max-handoffs-per-session"):
                a.handoff("h3", ids[2:], 1)
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


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "fast"])
def test_a_claim_whose_caller_left_takes_nothing(pool_process: PoolProcess, transport: str) -> None:
    """A claim waits in the pool; its caller goes away (an HTTP client's time-out, a closed connection): the next
    handoff must stay parked for whoever claims next, not go into the session with nobody to learn its ids."""
    with PoolClient(pool_process.url, name="owner", fast=False) as owner, PoolClient(pool_process.url, name="p") as p:
        body = {"session_id": owner.session_id, "request_id": None, "timeout_s": 30.0}
        if transport == "http":
            with pool_process.http(timeout_s=0.3) as http, pytest.raises(httpx.TimeoutException):
                http.post("/claim", json=body)
        else:
            conn = hello(pool_process)
            conn.sock.sendall(frame(b"claim", json.dumps(body).encode()))
            wait_until(lambda: pool_process.stats().get("claims_waiting", 1) == 1)
            conn.close()
        wait_until(lambda: pool_process.stats().get("claims_waiting", 0) == 0)
        ids = p.alloc(2)
        p.handoff("after", ids, 8)
        assert pool_process.stats()["handoffs"] == 1
        got = owner.claim(None, timeout_s=5)
        assert (got.request_id, got.block_ids) == ("after", ids)
        owner.free(got.ids)
    s = pool_process.stats()
    assert (s["in_use"], s["handoffs"]) == (0, 0)


def test_an_interrupted_call_never_hands_its_answer_to_the_next(pool_server: LocalPool) -> None:
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


# -- connections held open: a cap per listener, a deadline per request ------------------------------------------


def half_open(port: int, n: int, data: bytes = b"GET /health HTTP/1.1\r\nhost: kvp") -> list[socket.socket]:
    """``n`` TCP connections that each send the start of a request and no more: what any local user can hold."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(data)
        out.append(s)
    return out


def outcome(s: socket.socket, until: float) -> tuple[bytes, float]:
    """What the pool sent before it closed ``s`` (reset: b"reset"), and when it closed it."""
    data = b""
    try:
        while True:
            s.settimeout(max(0.01, until - time.monotonic()))
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        data = data or b"reset"
    except TimeoutError:
        data = b"still open"
    finally:
        s.close()
    return data, time.monotonic()


def unix_calls(pool: PoolProcess, token: str, n: int = 20) -> list[float]:
    """Alloc + free pairs of a token holder over the Unix socket, on both transports; their durations."""
    took = []
    with (
        PoolClient(pool.url, name="u-http", token=token, fast=False) as slow,
        PoolClient(pool.url, name="u-fast", token=token) as fast,
    ):
        for client in (slow, fast) * (n // 2):
            start = time.perf_counter()
            client.free(client.alloc(2))
            took.append(time.perf_counter() - start)
    return took


def unix_stats(pool: PoolProcess, token: str) -> dict[str, Any]:
    with http_client(pool.url, token, 10.0) as h:
        stats: dict[str, Any] = h.get("/stats").json()
        return stats


@pytest.mark.slow
def test_half_open_tcp_connections_are_capped_and_cut_off_and_never_starve_the_unix_socket() -> None:
    """Another local user holds half-sent requests open on the TCP port: past the TCP listener's cap each new one
    is refused at once, each held one is closed once the read deadline passes, the pool says so, and the token
    holders on the Unix socket are answered all along."""
    cap, deadline = 50, 1.0
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN, "KVPOOL_MAX_HTTP_CONNECTIONS": str(cap),
                                        "KVPOOL_READ_TIMEOUT_S": str(deadline)})  # fmt: skip
    try:
        with http_client(pool.tcp_url, TOKEN, 10.0) as keep:  # a TCP client idle between requests is not cut
            assert keep.get("/stats").status_code == 200
            opened = time.monotonic()
            held = half_open(pool.port, cap - 2)  # and ``keep``: one short of the cap
            body = (
                f"POST /alloc HTTP/1.1\r\nhost: kvp\r\nauthorization: Bearer {TOKEN}\r\ncontent-length: 100\r\n\r\n{{"
            )
            held += half_open(pool.port, 1, body.encode())
            held += half_open(pool.port, 11)
            assert len(unix_calls(pool, TOKEN)) == 20
            results = [outcome(s, opened + deadline + 5.0) for s in held]
            answers = [data for data, _ in results]
            assert answers.count(b"still open") == 0
            timed_out = [data for data in answers if data.startswith(b"HTTP/1.1 408")]
            assert len(timed_out) == cap - 2  # past the deadline, where no request was being answered: a 408
            assert b"--read-timeout-s" in timed_out[0]
            assert answers.count(b"") == 1  # headers and part of a body: the app has its request, so just closed
            refused = [data for data in answers if not data.startswith(b"HTTP/1.1 408") and data]
            assert len(refused) == 11  # past the cap (a 429, or a reset for a request the pool did not read)
            assert all(data == b"reset" or data.startswith(b"HTTP/1.1 429") for data in refused), refused
            assert all(when - opened < deadline + 3.0 for _, when in results)
            time.sleep(deadline + 0.5)
            assert keep.get("/stats").status_code == 200
        s = unix_stats(pool, TOKEN)
        assert s["limits_exceeded"] == {"max_http_connections": 11, "read_timeout_s": cap - 1}
        wait_until(lambda: "read-timeout-s 1" in pool.output(), timeout_s=15)
        log = pool.output()
        assert f"TCP connections past --max-http-connections {cap}" in log, log
        assert "TCP connections that sent no whole request within --read-timeout-s 1" in log, log
    finally:
        pool.stop()


HEALTH = b"GET /health HTTP/1.1\r\nhost: kvp\r\n\r\n"


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_pipelined_requests_without_the_token_hold_no_memory_and_leave_the_unix_socket_served() -> None:
    """Issue 46, finding 4: one write of 7,000 pipelined ``GET /health`` a connection, from 20 connections that read
    no answer. The pool parses one request of a connection at a time (and one of its peer's at a time before the
    token), so it holds a read's bytes a connection, not 140,000 parsed requests (about 300 MB, where each was
    parsed as it came); the token holders on the Unix socket are answered meanwhile."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN})
    attackers: list[socket.socket] = []
    try:
        before = resident_bytes(pool.proc.pid)
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", pool.port), timeout=5)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.send(HEALTH * 7000)  # what the kernel takes at once
            attackers.append(s)
        peak = before
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            peak = max(peak, resident_bytes(pool.proc.pid))
            time.sleep(0.02)
        assert len(unix_calls(pool, TOKEN)) == 20
        peak = max(peak, resident_bytes(pool.proc.pid))
        assert peak - before < 64 << 20, f"the pool grew by {(peak - before) >> 20} MiB"
    finally:
        for s in attackers:
            s.close()
        pool.stop()


@pytest.mark.slow
def test_every_pipelined_request_is_answered_in_order() -> None:
    """Parsing one request at a time loses none: requests pipelined across reads, split mid-head and with bodies
    (a body is parsed by its length, never past it), each get their answer, in order."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN})
    bodied = f"GET /none HTTP/1.1\r\nauthorization: Bearer {TOKEN}\r\ncontent-length: 9\r\n\r\nGET /xy\r\n".encode()
    wrong = b"GET /stats HTTP/1.1\r\nhost: kvp\r\n\r\n"  # refused (401): no token
    stream = (HEALTH * 3000 + bodied * 500 + wrong * 500) * 2
    try:
        with socket.create_connection(("127.0.0.1", pool.port), timeout=30) as s:
            sender = threading.Thread(
                target=lambda: [s.sendall(stream[i : i + 1000]) for i in range(0, len(stream), 1000)]
            )
            sender.start()
            data = b""
            while data.count(b"HTTP/1.1 ") < 8000:
                chunk = s.recv(1 << 16)
                assert chunk, "the pool closed the connection"
                data += chunk
            sender.join()
        statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
        assert statuses == ([b"200"] * 3000 + [b"404"] * 500 + [b"401"] * 500) * 2
    finally:
        pool.stop()


@pytest.mark.slow
def test_what_needs_no_token_takes_no_body_and_no_long_head() -> None:
    """``/health`` (open to all) with a body is refused before the body is read (it was read up to
    --max-body-bytes, for anyone), and a request head over 16 KiB is refused before it is parsed whole."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN})
    try:
        (s,) = half_open(pool.port, 1, b"GET /health HTTP/1.1\r\nhost: kvp\r\ncontent-length: 16000000\r\n\r\n")
        data, _ = outcome(s, time.monotonic() + 5)
        assert data.startswith(b"HTTP/1.1 413") and b"takes no request body" in data, data
        (s,) = half_open(pool.port, 1, b"GET /health HTTP/1.1\r\nhost: kvp\r\nx-junk: " + b"a" * (20 << 10))
        data, _ = outcome(s, time.monotonic() + 5)
        assert data.startswith(b"HTTP/1.1 431"), data
        with pool.http() as http:
            assert http.get("/health").status_code == 200
    finally:
        pool.stop()


@pytest.mark.slow
def test_upgrade_requests_give_their_connection_back() -> None:
    """A WebSocket upgrade request (the pool serves none) is answered, and its connection, once closed, leaves room
    under the cap again, as any other does (an upgraded connection would leave its count behind for good)."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_MAX_HTTP_CONNECTIONS": "2"})
    upgrade = (
        b"GET /health HTTP/1.1\r\nhost: kvp\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    )
    try:
        for _ in range(5):
            (s,) = half_open(pool.port, 1, upgrade)
            assert s.recv(9) == b"HTTP/1.1 "
            s.close()
        with pool.http() as http:
            wait_until(lambda: http.get("/health").status_code == 200)
    finally:
        pool.stop()


def limit_open_files(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_pool_allowed_few_files_keeps_room_for_the_unix_socket() -> None:
    """The issue's attack as it was: a pool that may open 400 files, another user holding 500 half-sent requests on
    the TCP port. Its caps fit under the limit, so the Unix socket's token holders are still answered."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN}, preexec_fn=limit_open_files(400, 400))
    held: list[socket.socket] = []
    try:
        held = half_open(pool.port, 500)
        assert len(unix_calls(pool, TOKEN)) == 20
        assert unix_stats(pool, TOKEN)["limits_exceeded"]["max_http_connections"] >= 500 - 33
        assert "connections capped at tcp 33, unix 33, fast 133" in pool.output(), pool.output()
    finally:
        for s in held:
            s.close()
        pool.stop()


@pytest.mark.slow
def test_the_pool_raises_its_soft_open_files_limit_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    pool = start_pool(*SMALL_POOL, preexec_fn=limit_open_files(256, hard))
    try:
        limits = Path(f"/proc/{pool.proc.pid}/limits").read_text()
        (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
        soft_now, hard_now = line.split()[3:5]
        assert soft_now == hard_now != "256", line
    finally:
        pool.stop()


@pytest.mark.slow
def test_partial_fast_channel_frames_are_cut_off_and_the_token_holders_go_on() -> None:
    """Strangers that never finish their hello, and a token holder's connections that send part of a frame after
    it, are closed once their deadline passes; an idle connection between frames is not; the others are served."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN, "KVPOOL_READ_TIMEOUT_S": "1",
                                        "KVPOOL_HELLO_TIMEOUT_S": "1"})  # fmt: skip
    path = f"{pool.socket}.fast"
    try:
        idle = hello(pool, TOKEN)
        opened = time.monotonic()
        strangers, partial = [], []
        for i in range(30):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(b"\x10\x00")  # half a header
            strangers.append(s)
            conn = hello(pool, TOKEN)  # then half a header, or all of a frame but its end
            conn.sock.sendall(b"\x10\x00" if i % 2 else frame(b"alloc", b'{"session_id": "x", "num_blocks": 1}')[:-10])
            partial.append(conn.sock)
        assert len(unix_calls(pool, TOKEN)) == 20
        results = [outcome(s, opened + 6.0) for s in strangers + partial]
        assert all(data == b"" for data, _ in results), results
        assert all(when - opened < 1.0 + 3.0 for _, when in results)
        time.sleep(0.5)
        assert idle.call(b"hello", json.dumps({"token": TOKEN}).encode())[0] == 200  # idle between frames: kept
        idle.close()
        assert unix_stats(pool, TOKEN)["limits_exceeded"] == {"hello_timeout_s": 30, "read_timeout_s": 30}
        wait_until(lambda: "sent part of a frame" in pool.output(), timeout_s=15)
        assert "fast-channel connections that said no hello within --hello-timeout-s 1" in pool.output()
    finally:
        pool.stop()


@pytest.mark.slow
def test_wrong_hellos_one_after_another_do_not_keep_a_stranger_connected() -> None:
    """The hello deadline runs from the connection's start: a refused hello does not start it again."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN, "KVPOOL_HELLO_TIMEOUT_S": "1"})
    try:
        conn = FastConnection(f"{pool.socket}.fast", timeout_s=10)
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            while time.monotonic() - start < 6.0:
                assert conn.call(b"hello", b'{"token": "wrong"}')[0] == 401
                time.sleep(0.2)
        assert time.monotonic() - start < 1.0 + 3.0
    finally:
        pool.stop()


@pytest.mark.slow
def test_frames_being_read_share_one_budget() -> None:
    """The bytes of frames being read are bounded by --max-fast-buffer-bytes, whatever the number of connections:
    a frame past the budget is refused (429, "send it again"), while smaller ones go on."""
    body_max, budget = 64 << 10, 100_000
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_MAX_BODY_BYTES": str(body_max),
                                        "KVPOOL_MAX_FAST_BUFFER_BYTES": str(budget)})  # fmt: skip
    try:
        slow = hello(pool)
        big = frame(b"lookup", b'{"session_id": "x", "token_ids": [' + b"1," * 29_000 + b"1]}")
        assert budget // 2 < len(big) - 4 <= body_max
        slow.sock.sendall(big[:-1000])  # holds what it sent of its frame in the budget while it is read
        time.sleep(0.3)  # read by the pool, as far as it came
        other = hello(pool)
        status, reply = other.call(b"lookup", big[HEADER_SIZE + len(b"lookup\n") :])
        assert status == 429 and b"--max-fast-buffer-bytes" in reply, reply
        with pytest.raises(ConnectionError):  # and closed: the rest of its frame is not read
            other.call(b"hello", b"{}")
        small = hello(pool)
        assert small.call(b"hello", b"{}")[0] == 200
        slow.sock.sendall(big[-1000:])
        status, reply = slow.receive()
        assert status == 404 and b"unknown session" in reply  # read whole, answered: the budget is free again
        again = hello(pool)
        assert again.call(b"lookup", big[HEADER_SIZE + len(b"lookup\n") :])[0] == 404
        assert pool.stats()["limits_exceeded"] == {"max_fast_buffer_bytes": 1}
    finally:
        pool.stop()


@pytest.mark.slow
def test_frames_that_stall_after_their_length_hold_no_budget() -> None:
    """Issue 46, finding 5: connections that send a frame's length and nothing more (four bytes each) took the
    whole budget, as the frame's size was reserved when its length came. The budget counts bytes as they come: 40
    such connections, each announcing the largest frame, leave the others' large frames served."""
    body_max, budget = 64 << 10, 100_000
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_MAX_BODY_BYTES": str(body_max), "KVPOOL_TOKEN": TOKEN,
                                        "KVPOOL_MAX_FAST_BUFFER_BYTES": str(budget)})  # fmt: skip
    stalled = []
    try:
        for _ in range(40):
            conn = hello(pool, TOKEN)
            conn.sock.sendall(HEADER.pack(body_max))
            stalled.append(conn)
        big = b'{"session_id": "x", "token_ids": [' + b"1," * 29_000 + b"1]}"
        other = hello(pool, TOKEN)
        for _ in range(5):
            status, reply = other.call(b"lookup", big)
            assert status == 404 and b"unknown session" in reply, reply
        assert len(unix_calls(pool, TOKEN)) == 20
        assert unix_stats(pool, TOKEN)["limits_exceeded"] == {}
    finally:
        for conn in stalled:
            conn.close()
        pool.stop()


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


@pytest.mark.slow
def test_a_socket_of_ours_in_a_private_directory_passes(pool_process: PoolProcess) -> None:
    assert stat.S_IMODE(pool_process.socket.parent.stat().st_mode) & 0o022 == 0
    with PoolClient(pool_process.url, name="fine") as ok:
        assert ok.health().status == "ok"


@pytest.mark.slow
def test_one_peer_s_kept_handoffs_leave_the_others_their_share(tmp_path: Path) -> None:
    """Finding 6: kept handoffs over one block, addressed to the attacker's own idle sessions, fill the attacker's
    share of --max-handoffs (and its sessions its share of --max-sessions), never the pool's: the workers (here the
    pool's own user on the Unix socket, where the attacker came over TCP) still open sessions and park."""
    pool = start_pool(*SMALL_POOL, "--max-handoffs", "64", "--max-handoffs-per-peer", "16", "--max-sessions", "16",
                      "--max-sessions-per-peer", "4")  # fmt: skip
    try:
        with (
            PoolClient(pool.tcp_url, name="attacker") as attacker,
            PoolClient(pool.tcp_url, name="idle-1"),
            PoolClient(pool.tcp_url, name="idle-2"),
            pool.http() as http,
        ):
            assert http.post("/sessions", json={"name": "idle-3"}).status_code == 200
            r = http.post("/sessions", json={"name": "idle-4"})
            assert r.status_code == 429 and "KVPOOL_MAX_SESSIONS_PER_PEER" in r.json()["detail"], r.text
            block = attacker.alloc(1)
            attacker.commit(block, list(range(4)))
            for i in range(16):
                attacker.handoff(f"k{i}", block, 4, to=f"idle-{1 + i % 2}", keep=True)
            with pytest.raises(LimitExceeded, match="max-handoffs-per-peer"):
                attacker.handoff("k16", block, 4, to="idle-1", keep=True)
            workers = [PoolClient(pool.url, name=f"worker-{i}") for i in range(6)]  # past 4: no share of its own
            with contextlib.ExitStack() as stack:
                p, d, *_ = (stack.enter_context(w) for w in workers)
                p.handoff("r", p.alloc(2), 8, to="worker-1")
                assert len(d.claim("r", timeout_s=5).block_ids) == 2
    finally:
        pool.stop()


@pytest.mark.slow
def test_a_pinned_name_is_its_user_s_from_the_pool_s_start_and_after_a_restart() -> None:
    """Finding 7: --names pins decode-0 to this user and prefill-* to another: nobody else opens them, with any key,
    over either listener, at the first moment the pool answers /health, nor after the pool restarts."""
    me = os.getuid()
    pins = f"decode-0={me},prefill-*={me + 1}"
    for _ in range(2):  # started, then started again: the pins come from the settings, not from who came first
        pool = start_pool(*SMALL_POOL, "--names", pins)
        try:
            with http_client(pool.url, None, 10.0) as unix, pool.http() as tcp:
                for client, name in ((unix, "prefill-0"), (tcp, "decode-0"), (unix, "prefill-7")):
                    r = client.post("/sessions", json={"name": name, "name_key": "a squatter's own key"})
                    assert r.status_code == 409 and "pinned" in r.json()["detail"], r.text
            with PoolClient(pool.url, name="decode-0", name_key="decode-0's own secret key") as d:
                assert d.session_id
            with pytest.raises(NameTaken, match="pinned"):
                PoolClient(pool.tcp_url, name="decode-0", name_key="decode-0's own secret key")
        finally:
            pool.stop()


@pytest.mark.slow
def test_a_keyed_name_is_bound_to_the_peer_that_keyed_it() -> None:
    """Finding 7: a second peer (here: over TCP, which the pool cannot tell apart from any other local user)
    cannot take a name keyed over the Unix socket while its worker is down, not even with its key."""
    pool = start_pool(*SMALL_POOL)
    try:
        key = "decode-0's key, seen in a log"
        PoolClient(pool.url, name="decode-0", name_key=key).close()
        with pytest.raises(NameTaken, match="another peer"):
            PoolClient(pool.tcp_url, name="decode-0", name_key=key)
        with PoolClient(pool.url, name="decode-0", name_key=key) as back:
            assert back.session_id
    finally:
        pool.stop()
