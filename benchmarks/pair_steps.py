"""The fast channel's alloc + free pair, step by step, in one process: every step of a real call but the socket.

``python -m kvpool.benchmarks.pair_steps [BLOCKS]`` runs the client's encoding and decoding, the pool's decoding,
books and reply (the same functions the fast channel calls) on a CPU pool, 300 pairs to warm up and then three
rounds of 1000; prints each step's mean in µs in the best round. Where the socket and the event loop add the same
to every revision, this shows what the ids cost: packing, unpacking, fencing and the books.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from kvpool.channel import decode, encode
from kvpool.ids import pack_ids
from kvpool.protocol import AllocRequest, AllocResponse, FreeRequest, FreeResponse, SessionCreate
from kvpool.server.config import PoolSettings
from kvpool.server.fastpath import _reply
from kvpool.server.plane import ControlPlane

#: whether free takes its ids packed (revisions before that decode them to a list)
PACKED = "packed" in inspect.signature(decode).parameters


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-pair-"))
    layout = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8}
    settings = PoolSettings(
        backend="cpu", num_blocks=2 * n + 64, socket=tmp / "s.sock", port=0, shm_dir=tmp / "shm", lease_ttl_s=3600,
        **layout,
    )  # fmt: skip
    plane = ControlPlane(settings)
    plane.start()
    sid = plane.open_session(SessionCreate(name="pair")).session_id
    spent: dict[str, int] = defaultdict(int)
    clock = time.perf_counter_ns

    def pair() -> None:
        t0 = clock()
        body = encode(AllocRequest(session_id=sid, num_blocks=n))
        t1 = clock()
        reply = _reply(plane.alloc(decode(AllocRequest, body)[0]))
        t2 = clock()
        ids = decode(AllocResponse, reply)[0].block_ids
        t3 = clock()
        body = encode(FreeRequest(session_id=sid, block_ids=[]), pack_ids(ids))
        t4 = clock()
        req = decode(FreeRequest, body, True)[0] if PACKED else decode(FreeRequest, body)[0]
        t5 = clock()
        reply = plane.free(req).model_dump_json().encode()
        t6 = clock()
        decode(FreeResponse, reply)
        t7 = clock()
        steps = ("client: alloc request", "pool: alloc + reply", "client: ids", "client: free request",
                 "pool: free's ids", "pool: free + reply", "client: answer")  # fmt: skip
        for name, a, b in zip(steps, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7), strict=True):
            spent[name] += b - a

    try:
        for _ in range(300):
            pair()
        best: dict[str, int] = {}
        for _ in range(3):
            spent.clear()
            for _ in range(1000):
                pair()
            if not best or sum(spent.values()) < sum(best.values()):
                best = dict(spent)
    finally:
        plane.close()
    print(f"alloc + free of {n} blocks, mean of 1000 pairs in the best of 3 rounds (µs):")
    for name, ns in best.items():
        print(f"  {name:24s} {ns / 1e6:8.1f}")
    print(f"  {'total':24s} {sum(best.values()) / 1e6:8.1f}")


if __name__ == "__main__":
    main()
