"""Who can reach the pool and what it accepts: loopback and an owner/group-only socket by default, the token on
every endpoint but ``/health`` (HTTP and the fast channel's hello), the arena handle only behind it, request
size limits, and nothing received ever unpickled."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.address import default_socket
from kvpool.channel import HEADER, FastConnection
from kvpool.client import PoolClient
from kvpool.errors import Unauthorized
from kvpool.server.config import PoolSettings
from tests.conftest import ROOT, SMALL_POOL, LocalPool, PoolProcess, free_port, local_pool, start_pool
from tests.server.balance import books
from tests.server.procs import SMALL_LAYOUT, serve

TOKEN = "s3cret-token-for-tests"


def uds_client(path: Path, token: str | None = None) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://kvpool", headers=headers)


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port``, read from /proc/net/tcp{,6}."""
    found = set()
    for name in ("tcp", "tcp6"):
        table = Path("/proc/net") / name
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            addr, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                if name == "tcp":
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


# -- where it listens, and with which permissions ------------------------------------------------------------


def test_default_settings_are_loopback_and_owner_group_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVPOOL_"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    s = PoolSettings()
    assert s.host == "127.0.0.1"
    assert s.socket_mode == 0o660
    assert s.token is None
    assert s.socket is not None and s.socket.parent.name == f"kvpool-{os.getuid()}"


def test_the_default_socket_is_in_the_users_runtime_directory_where_there_is_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket() == tmp_path / "kvpool" / "kvpool.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))  # set but not there: the shared fallback
    assert default_socket().parent.name == f"kvpool-{os.getuid()}"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc/net")
def test_served_with_defaults_listens_on_loopback_and_a_private_socket() -> None:
    """No --host, no --socket: TCP on 127.0.0.1 only, the socket 0660 in a directory nobody else can write."""
    tmp = Path(tempfile.mkdtemp(prefix="kvp-default-"))
    port = free_port()
    sock = tmp / f"kvpool-{os.getuid()}" / "kvpool.sock"
    pool = serve([*SMALL_LAYOUT, "--port", str(port)], port=port, socket=sock,
                 env={"TMPDIR": str(tmp), "XDG_RUNTIME_DIR": ""})  # fmt: skip
    try:
        assert listening_addresses(port) == {"127.0.0.1"}
        for path in (sock, Path(f"{sock}.fast")):
            st = path.stat()
            assert stat.S_ISSOCK(st.st_mode), path
            assert stat.S_IMODE(st.st_mode) == 0o660, f"{path}: {oct(st.st_mode)}"
            assert st.st_uid == os.getuid()
        parent = sock.parent.stat()
        assert parent.st_uid == os.getuid()
        assert stat.S_IMODE(parent.st_mode) & 0o027 == 0, f"socket dir is {oct(parent.st_mode)}"
        with uds_client(sock) as h:
            arena = h.get("/arena").json()
        # The CPU arena is a file only its owner can open: the KV is not readable by other local users.
        assert stat.S_IMODE(Path(arena["handle"]).stat().st_mode) == 0o600
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_refuses_a_world_writable_socket_directory() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvp-ww-"))
    tmp.chmod(0o777)  # no sticky bit: anyone could rename a socket of theirs over the pool's
    try:
        pool = serve([*SMALL_LAYOUT, "--port", "0", "--socket", str(tmp / "kvpool.sock")], port=0,
                     socket=tmp / "kvpool.sock", wait=False)  # fmt: skip
        rc = pool.proc.wait(timeout=60)
        assert rc != 0
        assert "world-writable" in pool.output()
        assert not (tmp / "kvpool.sock").exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_never_takes_over_a_live_pools_socket() -> None:
    """A second pool on the same socket path refuses to start; the first keeps serving on it."""
    first = start_pool(*SMALL_POOL)
    try:
        second = serve([*SMALL_LAYOUT, "--port", "0", "--socket", str(first.socket)], port=0, socket=first.socket,
                       wait=False)  # fmt: skip
        assert second.proc.wait(timeout=60) != 0
        assert "another pool is listening" in second.output()
        with uds_client(first.socket) as h:
            assert h.get("/health").json()["epoch"] == first.stats()["epoch"]
    finally:
        first.stop()


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_refuses_a_socket_directory_owned_by_another_user() -> None:
    """The default path lives in /tmp: a directory squatted there by someone else must not be used."""
    tmp = Path(tempfile.mkdtemp(prefix="kvp-squat-"))
    squatted = tmp / "kvpool-0"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, 54321, 54321)
    try:
        pool = serve([*SMALL_LAYOUT, "--port", "0"], port=0, socket=squatted / "kvpool.sock",
                     env={"TMPDIR": str(tmp)}, wait=False)  # fmt: skip
        rc = pool.proc.wait(timeout=60)
        assert rc != 0
        assert "belongs to uid 54321" in pool.output()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- the token ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_pool() -> Iterator[PoolProcess]:
    """A pool whose token comes from KVPOOL_TOKEN (the --token flag has its own test)."""
    pool = start_pool(*SMALL_POOL, env={"KVPOOL_TOKEN": TOKEN})
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def token_local() -> Iterator[LocalPool]:
    """The same pool in this process, for what a client sees of the token (the listeners' own checks need
    ``token_pool``)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPOOL_TOKEN", TOKEN)
        pool = local_pool(*SMALL_POOL)
    yield pool
    pool.stop()


def _every_endpoint(pool: PoolProcess) -> list[tuple[str, str]]:
    with pool.http(TOKEN) as h:
        spec = h.get("/openapi.json")
    assert spec.status_code == 200
    routes = [
        (method.upper(), path.replace("{session_id}", "some-session"))
        for path, item in spec.json()["paths"].items()
        for method in item
    ]
    extra = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect"),
             ("GET", "/no-such-path"), ("DELETE", "/stats")]  # fmt: skip
    return routes + extra


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "uds"])
def test_token_required_on_every_endpoint_but_health(token_pool: PoolProcess, transport: str) -> None:
    endpoints = _every_endpoint(token_pool)
    assert ("POST", "/alloc") in endpoints and ("GET", "/arena") in endpoints

    def client(authorization: str | None) -> httpx.Client:
        c = uds_client(token_pool.socket) if transport == "uds" else httpx.Client(base_url=token_pool.tcp_url)
        if authorization is not None:
            c.headers["authorization"] = authorization
        return c

    refused = [client(None), client("Bearer wrong"), client(f"Basic {TOKEN}"), client(f"Bearer {TOKEN[:-1]}"),
               client("Bearer"), client(TOKEN), client(f"Bearer {TOKEN}x")]  # fmt: skip
    for method, path in endpoints:
        if (method, path) == ("GET", "/health"):
            continue
        for c in refused:
            r = c.request(method, path, json={})
            assert r.status_code == 401, (method, path, c.headers.get("authorization"), r.status_code, r.text)
            assert "token" in r.json()["detail"]
            assert TOKEN not in r.text
    with client(f"bearer {TOKEN}") as ok:  # the scheme is case-insensitive
        for method, path in endpoints:
            r = ok.request(method, path, json={})
            assert r.status_code != 401, (method, path, r.text)
    for c in refused:
        assert c.get("/health").status_code == 200
        c.close()


@pytest.mark.slow
def test_arena_handle_only_for_callers_with_the_token(token_pool: PoolProcess) -> None:
    with token_pool.http(TOKEN) as h:
        arena = h.get("/arena").json()
    assert arena["handle"] and arena["backend"] == "cpu"
    with token_pool.http() as h:
        r = h.get("/arena")
    assert r.status_code == 401
    assert arena["handle"] not in r.text and "handle" not in r.text
    with uds_client(token_pool.socket, "wrong") as h:
        r = h.get("/arena")
    assert r.status_code == 401 and arena["handle"] not in r.text


@pytest.mark.slow
def test_unauthorized_body_is_not_read(token_pool: PoolProcess) -> None:
    """The token is checked before the body: a stranger announcing 50 MB gets a 401 without sending a byte of it
    (not a 413, and no read that waits for the body)."""
    with socket.create_connection(("127.0.0.1", token_pool.port), timeout=10) as raw:
        raw.sendall(b"POST /alloc HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 50000000\r\n\r\n")  # fmt: skip
        status_line = raw.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 401"), status_line


def test_pool_client_needs_the_token(token_local: LocalPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    with pytest.raises(Unauthorized, match="token"):
        PoolClient(token_local.url, name="no-token")
    with pytest.raises(Unauthorized, match="token"):
        PoolClient(token_local.url, name="bad-token", token="guess")
    before = books(token_local.stats(TOKEN))
    with PoolClient(token_local.url, name="ok", token=TOKEN) as c:
        assert c.transport.fast_path is not None, "the token must also open the fast channel (its hello)"
        ids = c.alloc(2)
        assert c.free(ids) == 2
        assert c.descriptor().handle
    assert books(token_local.stats(TOKEN)) == before


def test_pool_client_reads_the_token_from_the_environment(
    token_local: LocalPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
    with PoolClient(token_local.url, name="env-token") as c:
        assert len(c.alloc(1)) == 1


def test_fast_channel_hello_checks_the_token(token_local: LocalPool) -> None:
    with PoolClient(token_local.url, name="owner", token=TOKEN, fast=False) as owner:
        heartbeat = json.dumps({"session_id": owner.session_id}).encode()
        alloc = json.dumps({"session_id": owner.session_id, "num_blocks": 1}).encode()
        before = books(token_local.stats(TOKEN))
        conn = FastConnection(f"{token_local.socket}.fast", timeout_s=10)
        try:
            status, reply = conn.call(b"alloc", alloc)
            assert status == 401 and "hello" in json.loads(reply)["detail"]
            for hello in (b"{}", b'{"token": null}', b'{"token": "guess"}', json.dumps({"token": TOKEN[:-1]}).encode()):
                status, reply = conn.call(b"hello", hello)
                assert status == 401, hello
                assert "token" in json.loads(reply)["detail"]
                status, _ = conn.call(b"alloc", alloc)
                assert status == 401, f"an op passed after a refused hello {hello!r}"
            assert books(token_local.stats(TOKEN)) == before
            status, _ = conn.call(b"hello", json.dumps({"token": TOKEN}).encode())
            assert status == 200
            status, _ = conn.call(b"heartbeat", heartbeat)
            assert status == 200
        finally:
            conn.close()


def test_token_from_the_command_line() -> None:
    pool = local_pool(*SMALL_POOL, "--token", "from-the-flag")
    try:
        with pool.http() as h:
            assert h.get("/stats").status_code == 401
            assert h.get("/health").status_code == 200
        with pool.http("from-the-flag") as h:
            assert h.get("/stats").status_code == 200
        with PoolClient(pool.url, name="flag", token="from-the-flag") as c:
            assert len(c.alloc(1)) == 1
    finally:
        pool.stop()


# -- request size limits -----------------------------------------------------------------------------------

LIMIT = 4096


@pytest.fixture(scope="module")
def small_limit_pool() -> Iterator[PoolProcess]:
    pool = start_pool(*SMALL_POOL, "--max-body-bytes", str(LIMIT))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def small_limit_local() -> Iterator[LocalPool]:
    pool = local_pool(*SMALL_POOL, "--max-body-bytes", str(LIMIT))
    yield pool
    pool.stop()


def _big_free(session_id: str, size: int) -> bytes:
    """A valid /free body of about ``size`` bytes (its ids are never reached: the size check comes first)."""
    head = b'{"session_id": "%s", "block_ids": [' % session_id.encode()
    ids = b",".join(b"0" for _ in range(max(1, (size - len(head) - 2) // 2)))
    return head + ids + b"]}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "uds"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_oversize_body_is_413(small_limit_pool: PoolProcess, transport: str, framing: str) -> None:
    with PoolClient(small_limit_pool.url, name="owner") as owner:
        owner.alloc(1)
        body = _big_free(owner.session_id, LIMIT + 100)
        assert len(body) > LIMIT
        before = books(small_limit_pool.stats())
        h = uds_client(small_limit_pool.socket) if transport == "uds" else small_limit_pool.http()
        with h:
            if framing == "chunked":

                def chunks() -> Iterator[bytes]:
                    for i in range(0, len(body), 512):
                        yield body[i : i + 512]

                content: bytes | Iterator[bytes] = chunks()
            else:
                content = body
            r = h.post("/free", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert f"over {LIMIT} bytes" in r.json()["detail"]
            if framing == "chunked":
                assert "content-length" not in {k.lower() for k in r.request.headers}
        assert books(small_limit_pool.stats()) == before


def test_body_under_the_limit_is_served(small_limit_local: LocalPool) -> None:
    with PoolClient(small_limit_local.url, name="owner", fast=False) as owner:
        (block,) = owner.alloc(1)
        body = json.dumps({"session_id": owner.session_id, "block_ids": [block], "pad": "x" * (LIMIT - 200)})
        assert LIMIT - 200 < len(body) <= LIMIT
        with small_limit_local.http() as h:
            r = h.post("/free", content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422 and "pad" in r.text  # read and parsed (refused for its unknown field)
        assert owner.free([block]) == 1


def test_oversize_fast_channel_frame_is_413_and_closes(small_limit_local: LocalPool) -> None:
    with PoolClient(small_limit_local.url, name="owner") as owner:
        before = books(small_limit_local.stats())
        conn = FastConnection(f"{small_limit_local.socket}.fast", timeout_s=10)
        try:
            assert conn.call(b"hello", b"{}")[0] == 200
            status, reply = conn.call(b"free", _big_free(owner.session_id, LIMIT + 100))
            assert status == 413
            assert "over" in json.loads(reply)["detail"]
            with pytest.raises((ConnectionError, OSError)):
                conn.call(b"heartbeat", json.dumps({"session_id": owner.session_id}).encode())
        finally:
            conn.close()
        # A header that announces a huge frame is refused before anything is read or allocated for it.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(10)
        try:
            raw.connect(f"{small_limit_local.socket}.fast")
            raw.sendall(HEADER.pack(0xFFFFFFFF))
            size = HEADER.unpack(raw.recv(HEADER.size, socket.MSG_WAITALL))[0]
            status = raw.recv(size, socket.MSG_WAITALL).split(b"\n", 1)[0]
            assert status == b"413"
        finally:
            raw.close()
        assert books(small_limit_local.stats()) == before
        assert len(owner.alloc(1)) == 1  # the client's own connection was not disturbed


# -- nothing on the wire is unpickled ----------------------------------------------------------------------

# Deserializers that can run code while loading, and the calls that use them.
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib",
                  "jsonpickle", "torch.multiprocessing", "multiprocessing.reduction"}  # fmt: skip
UNSAFE_NAMES = {"reduce_tensor", "rebuild_cuda_tensor", "Unpickler", "unsafe_load", "full_load"}
UNSAFE_CALLS = {"eval", "exec", "torch.load", "yaml.load", "np.load", "numpy.load"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_uses(path: Path) -> list[str]:
    """Imports and calls of code-running deserializers in one source file (code only: prose may name them)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if any(node.module == m or node.module.startswith(f"{m}.") for m in UNSAFE_MODULES):
                found.append(f"from {node.module} import")
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in UNSAFE_NAMES]
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, last = name.rpartition(".")
            if name in UNSAFE_CALLS or last in UNSAFE_NAMES or (head in UNSAFE_MODULES and "load" in last):
                found.append(f"call {name}")
    return [f"{path.name}:{use}" for use in found]


def test_nothing_received_is_unpickled() -> None:
    """The pool, the client and the workers parse only JSON and fixed binary frames; no code-running loader."""
    sources = [p for d in ("kvpool", "server", "workers") for p in sorted((ROOT / d).rglob("*.py"))]
    assert {"fastpath.py", "app.py", "client.py", "channel.py"} <= {p.name for p in sources}
    uses = [use for path in sources for use in unsafe_uses(path)]
    assert uses == [], "code-running deserializers in the package:\n" + "\n".join(uses)
    # The transports decode with pydantic's JSON parser.
    assert "model_validate_json" in (ROOT / "server" / "transports" / "fastpath.py").read_text()


def test_the_unpickling_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan above is only worth its silence if it does find these."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport torch\nfrom torch.multiprocessing.reductions import reduce_tensor\n"
        "def f(b):\n    return pickle.loads(b), torch.load(b), eval(b)\n"
    )
    uses = {u.split(":", 1)[1] for u in unsafe_uses(bad)}
    assert {"import pickle", "call pickle.loads", "call torch.load", "call eval"} <= uses
    assert "from torch.multiprocessing.reductions import" in uses
