"""A worker gone while the pool restores a prefix from the host tier for it loses nothing.

The restore runs inside the pool, in the worker's lookup call; the worst moment to die is after the request left
and before the answer came back: the pool restores the prefix into blocks the session now holds, and nobody reads
the answer. Here the "worker" writes a lookup on a raw socket and closes it at once (what the kernel does for a
process killed at that moment), and never heartbeats again. Its lease runs out, its refs come back, both tiers'
books balance, and the restored prefix is a cached hit for the next worker, with the bytes first written.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from tests.conftest import start_pool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
FLAGS = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "4", "--dtype", "float32",
         "--num-blocks", "8", "--host-blocks", "32", "--lease-ttl-s", "1")  # fmt: skip
PREFIX = list(range(900, 924))  # six blocks

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'


def lookup_and_vanish(port: int, session_id: str, tokens: list[int]) -> None:
    body = json.dumps({"session_id": session_id, "token_ids": tokens}).encode()
    head = f"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.encode() + body)


def test_a_worker_gone_mid_restore_loses_nothing() -> None:
    pool = start_pool(*FLAGS)
    try:
        with PoolClient(pool.url, name="writer", role="prefill", layout=LAYOUT) as writer:
            arena = writer.arena()
            ids = writer.alloc(6)
            for i, b in enumerate(ids):
                for t in arena.block(b):
                    t.fill_(100 + i)
            writer.commit(ids, PREFIX)
            writer.free(ids)
            writer.free(writer.alloc(8))  # the whole arena: the prefix goes to the host tier
        before = pool.stats()["tiers"]
        assert before["host"]["cached"] == 6
        with pool.http() as http:
            doomed = http.post("/sessions", json={"name": "doomed", "role": "prefill"}).json()["session_id"]
        lookup_and_vanish(pool.port, doomed, PREFIX)
        deadline = time.monotonic() + 15
        while True:
            stats = pool.stats()
            for t in stats["tiers"].values():
                assert t["free"] + t["in_use"] + t["cached"] == t["num_blocks"], stats["tiers"]
            if stats["sessions"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        tiers = stats["tiers"]
        assert stats["sessions"] == 0 and stats["counters"]["sessions_expired"] == 1
        assert tiers["host"]["hit_blocks"] == 6, "the lookup reached the pool and restored the prefix"
        assert tiers["gpu"]["in_use"] == 0 and tiers["host"]["in_use"] == 0
        assert tiers["gpu"]["cached"] == 6 and tiers["host"]["cached"] == 0
        with PoolClient(pool.url, name="next", role="prefill", layout=LAYOUT) as nxt:
            hit = nxt.lookup(PREFIX)
            assert hit.num_tokens == len(PREFIX)
            arena = nxt.arena()
            assert [float(arena.block(b)[0].flatten()[0]) for b in hit.block_ids] == [100 + i for i in range(6)]
            nxt.free(hit.block_ids)
        assert pool.stats()["tiers"]["gpu"]["hit_blocks"] == 6
    finally:
        pool.stop()
