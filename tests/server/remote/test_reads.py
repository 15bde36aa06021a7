"""Two real pools on this machine stand in for two nodes: NIXL reads between their host arenas over UCX (TCP)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvpool.client import PoolClient
from kvpool.server.remote.nixlagent import load_nixl
from tests.conftest import PoolProcess, free_port, stop_process
from tests.server.balance import assert_balanced, books
from tests.server.procs import SMALL_LAYOUT, serve

try:
    load_nixl()
except Exception as exc:  # whatever keeps NIXL from loading is the reason to skip
    pytest.skip(f"NIXL is not installed here ({exc})", allow_module_level=True)

# Two pool processes whose NIXL agents read each other's arenas over UCX TCP, and peers killed or stopped by signals:
# what only processes show, so the whole module is in the full suite only.
pytestmark = pytest.mark.slow

TOKEN = "t0ken-for-peers"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ENV = {"UCX_TLS": "tcp", "KVPOOL_TOKEN": TOKEN}


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def start(port: int, peers: list[str], *flags: str) -> PoolProcess:
    sock = Path(tempfile.mkdtemp(prefix="kvp-")) / "kvpool.sock"
    flags = (*SMALL_LAYOUT, "--lease-ttl-s", "3", "--peers", ",".join(peers), *flags)
    return serve(["--port", str(port), "--socket", str(sock), *flags], port=port, socket=sock, env=ENV)


class Proxy:
    """A's HTTP API as B sees it, which does ``act`` to A once A answered a call to ``path``, before B hears it:
    so B's read starts against a peer that is dead or stopped."""

    def __init__(self, target: str, path: str, act: Callable[[], None]) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                r = httpx.request(
                    self.command,
                    target + self.path,
                    content=body,
                    timeout=30,
                    headers={**AUTH, "content-type": "application/json"},
                )
                if self.path == path and r.status_code == 200:
                    proxy.acted = True
                    act()
                self.send_response(r.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_DELETE = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.acted = False
        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


class KillMidRead:
    """What a proxy of A does once A answered B's claim: stop A (so that B's read cannot end), then, from a thread,
    kill A once B's ``/stats`` shows the read in flight. The read is then posted and unfinished when its peer dies,
    whatever the machine's load."""

    def __init__(self, pid: int, b_port: int) -> None:
        self.pid, self.b_port = pid, b_port
        self.in_flight: dict[str, Any] = {}

    def __call__(self) -> None:
        stop_process(self.pid)
        threading.Thread(target=self._kill, daemon=True).start()

    def _kill(self) -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                remote = httpx.get(url(self.b_port) + "/stats", headers=AUTH, timeout=10).json()["remote"]
                if remote["reads_in_flight"]:
                    self.in_flight = remote
                    return
                time.sleep(0.01)
        finally:
            os.kill(self.pid, signal.SIGKILL)


@pytest.fixture
def pair() -> Iterator[tuple[PoolProcess, PoolProcess]]:
    a_port, b_port = free_port(), free_port()
    a = start(a_port, [url(b_port)])
    b = start(b_port, [url(a_port)])
    yield a, b
    b.stop()
    a.stop()


def stats(port: int) -> dict[str, Any]:
    s = httpx.get(url(port) + "/stats", headers=AUTH).json()
    assert_balanced(s)
    return s


def fill(client: PoolClient, ids: list[int], seed: int) -> list[torch.Tensor]:
    arena = client.arena()
    out = []
    for i, block in enumerate(ids):
        for t in arena.block(block):
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 1000 * (seed + i))
            out.append(t.clone())
    return out


def read(client: PoolClient, ids: list[int]) -> list[torch.Tensor]:
    arena = client.arena()
    return [t.clone() for block in ids for t in arena.block(block)]


def park(a: PoolProcess, request_id: str) -> list[torch.Tensor]:
    """Five blocks parked on A under ``request_id``, as two runs of ids (a gap after the first two)."""
    with PoolClient(url(a.port), name="prefill", token=TOKEN) as prefill:
        ids = prefill.alloc(6)
        prefill.free([ids[2]])
        handed = ids[:2] + ids[3:]
        want = fill(prefill, handed, 1)
        prefill.handoff(request_id, handed, num_tokens=20)
    return want


def remote_claim(b_port: int, session_id: str, peer: str, request_id: str) -> httpx.Response:
    body = {"session_id": session_id, "request_id": request_id, "peer": peer, "timeout_s": 5}
    return httpx.post(url(b_port) + "/remote/claim", json=body, headers=AUTH, timeout=60)


def test_remote_handoff_reads_the_runs_and_releases_the_peers_blocks(pair: tuple[PoolProcess, PoolProcess]) -> None:
    a, b = pair
    want = park(a, "req-1")
    with PoolClient(url(b.port), name="decode", token=TOKEN) as decode:
        r = remote_claim(b.port, decode.session_id, url(a.port), "req-1")
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["num_tokens"] == 20 and len(got["block_ids"]) == 5
        assert got["parked_by"] == "prefill", "the peer's word on who parked it, for the decode engine's check"
        assert all(torch.equal(x, y) for x, y in zip(read(decode, got["block_ids"]), want, strict=True))
        # A's ids are two runs ([0, 1], [3, 4, 5]), B's one: two runs on both sides, 2 layers x K and V each
        assert got["descriptors"] == 2 * 4
        assert stats(b.port)["in_use"] == 5
        assert stats(a.port)["in_use"] == 0 and stats(a.port)["handoffs"] == 0
    assert stats(b.port)["in_use"] == 0
    assert stats(b.port)["remote"]["reads"] == 1


def test_remote_prefix_is_read_indexed_and_found_here_after(pair: tuple[PoolProcess, PoolProcess]) -> None:
    a, b = pair
    tokens = list(range(100, 114))  # three full blocks of 4, and two tokens more
    with PoolClient(url(a.port), name="prefill", token=TOKEN) as prefill:
        ids = prefill.alloc(3)
        want = fill(prefill, ids, 7)
        prefill.commit(ids, tokens[:12])
        prefill.free(ids)
    with PoolClient(url(b.port), name="decode", token=TOKEN) as decode:
        body = {"session_id": decode.session_id, "token_ids": tokens}
        r = httpx.post(url(b.port) + "/remote/lookup", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["num_tokens"], got["read_blocks"], got["peer"]) == (12, 3, url(a.port))
        assert all(torch.equal(x, y) for x, y in zip(read(decode, got["block_ids"]), want, strict=True))
        decode.free(got["block_ids"])
        assert decode.lookup(tokens).block_ids == got["block_ids"]  # indexed here: a plain lookup finds them
        before = stats(b.port)
        r = remote_claim(b.port, decode.session_id, "http://127.0.0.1:1", "req-x")  # not in B's --peers
        assert r.status_code == 400 and "not a peer" in r.json()["detail"]
        assert {k: stats(b.port)[k] for k in ("free", "in_use", "cached")} == {
            k: before[k] for k in ("free", "in_use", "cached")
        }
    assert stats(a.port)["in_use"] == 0 and stats(a.port)["cached"] == 3
    assert stats(b.port)["in_use"] == 0 and stats(b.port)["cached"] == 3


def test_a_chain_of_another_model_is_never_installed(pair: tuple[PoolProcess, PoolProcess]) -> None:
    a, _ = pair
    tokens = list(range(8))
    with PoolClient(url(a.port), name="prefill", token=TOKEN) as prefill:
        ids = prefill.alloc(2)
        prefill.commit(ids, tokens, release=True)
    c = start(free_port(), [url(a.port)], "--model", "another-model")
    try:
        with PoolClient(url(c.port), name="decode", token=TOKEN) as decode:
            body = {"session_id": decode.session_id, "token_ids": tokens}
            got = httpx.post(url(c.port) + "/remote/lookup", json=body, headers=AUTH, timeout=60).json()
            assert got["block_ids"] == [] and got["read_blocks"] == 0
            assert "does not match" in got["peer_errors"][url(a.port)]
        s = stats(c.port)
        assert (s["in_use"], s["cached"], s["remote"]["chain_mismatch"], s["remote"]["reads"]) == (0, 0, 1, 0)
    finally:
        c.stop()
    assert stats(a.port)["in_use"] == 0


def test_a_peer_killed_before_the_read_fails_it_and_the_blocks_go_back() -> None:
    a_port, b_port = free_port(), free_port()
    a = start(a_port, [url(b_port)])
    proxy = Proxy(url(a_port), "/claim", lambda: os.kill(a.proc.pid, signal.SIGKILL))
    b = start(b_port, [url(proxy.port)])
    try:
        park(a, "req-2")
        with PoolClient(url(b_port), name="decode", token=TOKEN) as decode:
            r = remote_claim(b_port, decode.session_id, url(proxy.port), "req-2")
        assert proxy.acted
        assert r.status_code == 502, r.text
        assert "failed" in r.json()["detail"]
        s = stats(b_port)
        assert (s["in_use"], s["free"], s["remote"]["failed"]) == (0, 64, 1)
    finally:
        proxy.close()
        b.stop()
        a.stop()


def test_a_stalled_peer_times_out_and_its_blocks_come_back_once_the_read_ends() -> None:
    a_port, b_port = free_port(), free_port()
    a = start(a_port, [url(b_port)])
    proxy = Proxy(url(a_port), "/claim", lambda: stop_process(a.proc.pid))
    b = start(b_port, [url(proxy.port)], "--peer-timeout-s", "1")
    try:
        want = park(a, "req-3")
        with PoolClient(url(b_port), name="decode", token=TOKEN) as decode:
            t0 = time.monotonic()
            r = remote_claim(b_port, decode.session_id, url(proxy.port), "req-3")
            assert time.monotonic() - t0 < 30  # the read's deadline is 1 s: bounded, whatever the load
            assert r.status_code == 504, r.text
            assert "--peer-timeout-s" in r.json()["detail"]
            s = stats(b_port)  # the read's blocks are held, not handed to anyone, while the peer may still write
            assert (s["in_use"], s["remote"]["stalled_blocks"], s["remote"]["timed_out"]) == (5, 5, 1)
            os.kill(a.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while stats(b_port)["remote"]["stalled_reads"] and time.monotonic() < deadline:
                time.sleep(0.1)
            s = stats(b_port)
            assert (s["in_use"], s["free"], s["remote"]["stalled_blocks"]) == (0, 64, 0)
        deadline = time.monotonic() + 30  # B's session at A is released by A's lease expiry
        while stats(a_port)["in_use"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats(a_port)["in_use"] == 0 and len(want) == 20
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        proxy.close()
        b.stop()
        a.stop()


def test_a_peer_killed_mid_read_fails_it_in_bounded_time_and_the_blocks_go_back() -> None:
    a_port, b_port = free_port(), free_port()
    a = start(a_port, [url(b_port)])
    kill = KillMidRead(a.proc.pid, b_port)
    proxy = Proxy(url(a_port), "/claim", kill)
    b = start(b_port, [url(proxy.port)], "--peer-timeout-s", "60")
    try:
        park(a, "req-4")
        with PoolClient(url(b_port), name="decode", token=TOKEN) as decode:
            t0 = time.monotonic()
            r = remote_claim(b_port, decode.session_id, url(proxy.port), "req-4")
            took = time.monotonic() - t0
            assert kill.in_flight["reads_in_flight"] == 1 and kill.in_flight["reading_blocks"] == 5
            assert r.status_code == 502, r.text  # the peer's death, not the 60 s deadline, ended the read
            assert took < 45 and "died" in r.json()["detail"]
            s = stats(b_port)
            assert (s["in_use"], s["free"]) == (0, 64), "nothing installed, the read's blocks went back"
            assert s["remote"]["failed"] == 1 and s["remote"]["reads"] == 0
            assert (s["remote"]["reads_in_flight"], s["remote"]["stalled_blocks"]) == (0, 0)
            assert decode.alloc(64) and stats(b_port)["in_use"] == 64, "all of B's blocks can be had again"
    finally:
        proxy.close()
        b.stop()
        a.stop()


def test_a_remote_claim_with_its_prompt_indexes_what_the_peer_s_index_vouches_for(
    pair: tuple[PoolProcess, PoolProcess],
) -> None:
    a, b = pair
    tokens = list(range(200, 214))  # three full blocks of 4, and two tokens more
    with PoolClient(url(a.port), name="prefill", token=TOKEN) as prefill:
        for key in ("req-6", "req-7"):
            ids = prefill.alloc(3)
            want = fill(prefill, ids, 3)
            prefill.commit(ids, tokens[:12])  # req-7's blocks hold a copy the index does not name: not vouched for
            prefill.handoff(key, ids, num_tokens=12)
    with PoolClient(url(b.port), name="decode", token=TOKEN) as decode:
        body = {"session_id": decode.session_id, "request_id": "req-6", "peer": url(a.port), "token_ids": tokens}
        r = httpx.post(url(b.port) + "/remote/claim", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["indexed"] == 3
        assert all(torch.equal(x, y) for x, y in zip(read(decode, got["block_ids"]), want, strict=True))
        decode.free(got["block_ids"])
        assert decode.lookup(tokens).block_ids == got["block_ids"], "B's index finds the blocks it read"
        assert decode.lookup(tokens, salt="another-tenant").block_ids == []
        decode.free(got["block_ids"])
        other = httpx.post(url(b.port) + "/remote/claim", json={**body, "request_id": "req-7"}, headers=AUTH,
                           timeout=60).json()  # fmt: skip
        assert other["indexed"] == 0 and len(other["block_ids"]) == 3
        bad = httpx.post(url(b.port) + "/remote/claim", json={**body, "token_ids": [-1] * 12}, headers=AUTH)
        assert bad.status_code in (400, 422), "a token that is no token id is refused before anything is claimed"
        decode.free(other["block_ids"])
    s = stats(b.port)
    assert (s["in_use"], s["cached"], s["remote"]["claim_indexed"]) == (0, 3, 3)
    assert stats(a.port)["handoffs"] == 0 and stats(a.port)["in_use"] == 0


def test_a_remote_lookup_for_an_arena_past_the_first_is_refused_and_changes_nothing() -> None:
    p = start(free_port(), [url(free_port())], "--devices", "0,1")
    try:
        with PoolClient(url(p.port), name="decode", token=TOKEN) as decode:
            before = books(stats(p.port))
            body = {"session_id": decode.session_id, "token_ids": list(range(8)), "device": 1}
            r = httpx.post(url(p.port) + "/remote/lookup", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 400 and "first arena" in r.json()["detail"], r.text
            assert books(stats(p.port)) == before
    finally:
        p.stop()
