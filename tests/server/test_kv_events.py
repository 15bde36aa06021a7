"""A router rebuilds a real pool's prefix index from its KV events alone, missed events replayed, across a restart.

The subscriber (tests/server/kv_router.py) knows vLLM's schema and nothing of kvpool's code; what it rebuilds is
compared with the pool's own index (``GET /prefix/blocks``) after each phase of a workload of commits, lookups,
frees and evictions, and every hash whose chain it holds whole is recomputed from token ids as docs/kv-events.md
says a router would.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import xxhash
import zmq

from kvpool.server.launch import ServerProcess
from tests.conftest import free_port, start_pool
from tests.server.balance import assert_balanced
from tests.server.kv_router import Subscriber
from tests.server.procs import serve
from tests.test_cli import kvpool

BS = 4
NUM_BLOCKS = 48
LAYOUT = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", str(BS),
          "--dtype", "float32", "--model", "tiny")  # fmt: skip
NAMESPACE = f"kvpool/v1|tiny|L2|H2|D8|B{BS}|float32|layer_major"  # as docs/kv-events.md spells it
MASK64 = (1 << 64) - 1


def recomputed(tokens: list[int], form: str) -> list[Any]:
    """Block hashes from token ids, the way docs/kv-events.md tells a router to compute them."""
    key, out = xxhash.xxh3_128_digest(NAMESPACE.encode()), []
    for i in range(len(tokens) // BS):
        key = xxhash.xxh3_128_digest(key + b"".join(t.to_bytes(4, "little") for t in tokens[i * BS : (i + 1) * BS]))
        out.append(int.from_bytes(key, "big") & MASK64 if form == "int" else key)
    return out


class Workload:
    """Sessions that look prompts up, fill and commit the rest, and free or hold them: the pool evicts for room."""

    def __init__(self, pool: ServerProcess, seed: int) -> None:
        self.http = httpx.Client(base_url=pool.tcp_url, timeout=30)
        self.rng = random.Random(seed)
        self.sessions = [self.call("/sessions", name=f"w{i}", role="other")["session_id"] for i in range(3)]
        self.held: dict[str, list[list[int]]] = {s: [] for s in self.sessions}
        self.systems = [[self.rng.randrange(50_000) for _ in range(6 * BS)] for _ in range(4)]

    def call(self, path: str, **body: Any) -> Any:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def step(self) -> None:
        rng, sid = self.rng, self.rng.choice(self.sessions)
        system = rng.choice(self.systems)
        tokens = system[: rng.randint(1, 6) * BS] + [rng.randrange(50_000) for _ in range(rng.randint(0, 4 * BS))]
        hit = self.call("/lookup", session_id=sid, token_ids=tokens)["block_ids"]
        need = -(-len(tokens) // BS) - len(hit)
        ids = list(hit)
        if need:
            r = self.http.post("/alloc", json={"session_id": sid, "num_blocks": need})
            if r.status_code == 507:  # all held: let go of what this session holds and move on
                self.release(sid, hit)
                return
            assert r.status_code == 200, r.text
            ids += r.json()["block_ids"]
            self.call("/commit", session_id=sid, block_ids=ids, token_ids=tokens)
        if rng.random() < 0.25 and len(self.held[sid]) < 2:
            self.held[sid].append(ids)
        else:
            self.call("/free", session_id=sid, block_ids=ids)

    def release(self, sid: str, extra: list[int]) -> None:
        for ids in [*self.held[sid], extra]:
            if ids:
                self.call("/free", session_id=sid, block_ids=ids)
        self.held[sid] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def close(self) -> None:
        self.http.close()


def published(pool: ServerProcess) -> int:
    """Batches the pool has sent, once nothing it accepted is left unsent."""
    deadline = time.monotonic() + 20
    while True:
        stats = pool.stats()
        events = stats["kv_events"]
        assert events["dropped"] == 0, events
        if events["pending"] == 0:
            assert_balanced(stats)
            return int(events["next_seq"])
        assert time.monotonic() < deadline, events
        time.sleep(0.02)


def pool_view(pool: ServerProcess, form: str) -> dict[Any, tuple[Any, str, int]]:
    with pool.http() as h:
        listing = h.get("/prefix/blocks", params={"limit": 100_000}).json()
    assert not listing["truncated"] and listing["hashes"] == form

    def name(value: Any) -> Any:
        return bytes.fromhex(value) if isinstance(value, str) else value

    return {name(b["hash"]): (name(b["parent"]), b["medium"], b["rank"]) for b in listing["blocks"]}


def assert_rebuilt(sub: Subscriber, pool: ServerProcess, form: str) -> int:
    """The subscriber holds exactly the pool's index; each whole chain's hashes follow from its tokens."""
    sub.catch_up(published(pool))
    view = pool_view(pool, form)
    assert sub.index.view() == view
    whole = 0
    for h, entry in sub.index.blocks.items():
        chain = [entry]
        while chain[-1].parent is not None and chain[-1].parent in sub.index.blocks:
            chain.append(sub.index.blocks[chain[-1].parent])
        if chain[-1].parent is None:
            tokens = [t for e in reversed(chain) for t in e.tokens]
            assert recomputed(tokens, form)[-1] == h
            whole += 1
    return whole


def assert_metrics(pool: ServerProcess) -> None:
    """/metrics says what /stats says of the feed (nothing moves between the two reads: the pool is idle)."""
    with pool.http() as h:
        text = h.get("/metrics").text
    events = pool.stats()["kv_events"]
    names = {
        "kvpool_kv_events_published_total": "published",
        "kvpool_kv_events_dropped_total": "dropped",
        "kvpool_kv_event_replay_requests_total": "replay_requests",
        "kvpool_kv_event_batches_published_total": "batches",
        "kvpool_kv_events_pending": "pending",
    }
    for name, field in names.items():
        assert f"\n{name} {float(events[field])}\n" in text, name
    assert events["published"] > 0 and events["replay_requests"] > 0


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    yield free_port(), free_port()


@pytest.mark.slow
@pytest.mark.parametrize("form", [("int", "map"), ("bytes", "array")], ids=["int-map", "bytes-array"])
def test_router_rebuilds_index_from_events(form: tuple[str, str], ports: tuple[int, int]) -> None:
    hashes, shape = form
    events, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
    flags = ["--num-blocks", str(NUM_BLOCKS), *LAYOUT, "--kv-events-endpoint", events, "--kv-events-mode", "bind",
             "--kv-events-replay-endpoint", replay, "--kv-events-topic", "kvpool",
             "--kv-events-hashes", hashes, "--kv-events-form", shape, "--kv-events-buffer-steps", "100000"]  # fmt: skip
    pool = start_pool(*flags)
    sub: Subscriber | None = None
    work: Workload | None = None
    try:
        work = Workload(pool, seed=15)
        work.run(40)  # before anyone listens: the subscriber gets all of it by replay
        sub = Subscriber(events, replay, b"kvpool")
        sub.replay(0)
        assert assert_rebuilt(sub, pool, hashes) > 0
        stats = pool.stats()
        assert stats["evictions"] > 0 and stats["kv_events"]["replay_requests"] >= 1

        work.run(60)  # listening
        assert_rebuilt(sub, pool, hashes)

        sub.disconnect()  # away for a while: the gap shows in the sequence numbers and is replayed
        work.run(60)
        replays = sub.replays
        sub.connect()
        for _ in range(100):
            work.run(1)
            if sub.receive(200):
                break
        assert sub.replays > replays
        assert_rebuilt(sub, pool, hashes)
        for sid in work.sessions:
            work.release(sid, [])
        assert_rebuilt(sub, pool, hashes)
        assert len(sub.index.blocks) > 0
        assert_metrics(pool)
        work.close()

        socket_dir, pool.workdir = pool.workdir, None  # the new pool's socket goes there too: it removes it
        pool.stop(signal.SIGTERM)  # a new pool on the same addresses: its first batch clears what routers hold
        pool = serve([*flags, "--socket", str(pool.socket), "--port", str(pool.port)], port=pool.port,
                     socket=pool.socket)  # fmt: skip
        pool.workdir = socket_dir  # (serve's own log directory goes with the process object)
        work = Workload(pool, seed=16)
        for _ in range(100):
            work.run(1)
            if sub.receive(200) and sub.restarts:
                break
        assert sub.restarts == 1
        work.run(30)
        assert assert_rebuilt(sub, pool, hashes) > 0
        assert pool.stats()["evictions"] > 0
    finally:
        if work is not None:
            work.close()
        if sub is not None:
            sub.close()
        pool.stop()


@pytest.mark.slow
def test_an_endpoint_in_use_stops_the_pool_saying_which(tmp_path: Path, shm_dir: Path) -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        done = kvpool("serve", "--backend", "cpu", "--port", "0", "--socket", str(tmp_path / "s.sock"),
                      "--shm-dir", str(shm_dir), "--num-blocks", "8", "--log-level", "warning",
                      "--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--kv-events-mode", "bind")  # fmt: skip
    finally:
        taken.close(linger=0)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpool: could not start: ") and "--kv-events-endpoint" in last, done.stderr
    assert not list(shm_dir.glob("kvpool-*")), "the arena file was left behind"
