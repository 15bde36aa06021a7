"""The handoff benchmark's two processes: a producer standing for the prefill and a consumer for the decode.

Each runs one :class:`Actor` in a process of its own (spawned, so CUDA works in it), driven by :class:`Peer`
from the benchmark's process over a pipe of small commands; the timings cross processes on one clock.
"""

from __future__ import annotations

import contextlib
import time
from array import array
from typing import Any

from kvpool.benchmarks import harness

#: a layer's K and V: the tensors per layer the tensor variants move
NUM_TENSORS_PER_LAYER = 2


class Actor:
    """State of the producer or the consumer process: its pool clients, its mapping of the arena, its tensors."""

    def __init__(self, role: str, url: str, device: str, queue: Any, ready: Any, lead_s: float, spin_s: float) -> None:
        import torch
        import torch.multiprocessing  # registers the tensor reductions that the queue variant pickles with

        from kvpool.client import PoolClient

        self.torch = torch
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev)
            torch.empty(1, device=self.dev)  # a worker has its CUDA context long before any handoff
        kind = "prefill" if role == "producer" else "decode"
        direct = role == "consumer"
        self.clients = {
            "pool-direct": PoolClient(
                url, name=f"{role}-direct", role=kind, heartbeat=False, inbox=direct, spin_s=spin_s
            ),
            "pool-fast": PoolClient(url, name=f"{role}-fast", role=kind, heartbeat=False),
            "pool-http": PoolClient(url, name=f"{role}-http", role=kind, fast=False, heartbeat=False),
        }
        self.arena = self.clients["pool-fast"].arena()
        self.queue, self.ready, self.lead_s = queue, ready, lead_s
        self.src: list[Any] = []
        self.pinned: list[Any] = []
        self.sent: list[Any] = []

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def marks(self, ids: list[int]) -> tuple[Any, Any]:
        """The first element of the first block's layer-0 K and the last of the last block's last-layer V."""
        first, last = self.arena.local_ids([ids[0], ids[-1]])
        top = self.arena.layout.num_layers - 1
        return self.arena.k(0)[first].view(-1)[:1], self.arena.v(top)[last].view(-1)[-1:]

    # producer ----------------------------------------------------------------------------------------------

    def setup(self, nbytes: int) -> str:
        """Source tensors and pinned buffers of this size for the copy variants (made outside any timing); 0 frees
        the last size's, so that the next size has the device's memory."""
        torch = self.torch
        self.src = self.pinned = self.sent = []
        if self.cuda:
            torch.cuda.empty_cache()
        if not nbytes:
            return "released"
        n = self.numel(nbytes)
        self.src = [torch.ones(n, dtype=torch.float16, device=self.dev) for _ in range(self.num_tensors)]
        if self.cuda:
            self.pinned = [torch.empty(n, dtype=torch.float16, pin_memory=True) for _ in range(self.num_tensors)]
        self.sync()
        return "ok"

    @property
    def num_tensors(self) -> int:
        return self.arena.layout.num_layers * NUM_TENSORS_PER_LAYER

    def numel(self, nbytes: int) -> int:
        return max(1, nbytes // (2 * self.num_tensors))

    def handoff(
        self, variant: str, request_id: str, num_blocks: int, num_tokens: int, marker: float
    ) -> tuple[int, int]:
        client = self.clients[variant]
        ids = array("q", client.alloc(num_blocks))  # the prefill's block ids, fenced int64 as the pool gave them
        for mark in self.marks(ids):
            mark.fill_(marker)
        self.sync()  # the KV is written before it is handed off
        to = "consumer-direct" if variant == "pool-direct" else None
        if not self.ready.wait(60):
            raise RuntimeError("the consumer never put its claim in")
        self.ready.clear()
        time.sleep(self.lead_s)
        t0 = time.perf_counter_ns()
        client.handoff(request_id, ids, num_tokens, to=to)
        return t0, time.perf_counter_ns()

    def put(self, nbytes: int, marker: float) -> int:
        torch = self.torch
        self.sent = []
        n = self.numel(nbytes)
        tensors = [torch.empty(n, dtype=torch.float16, device=self.dev) for _ in range(self.num_tensors)]
        for t in tensors:
            t[:1].fill_(marker)
        self.sync()
        t0 = time.perf_counter_ns()
        self.queue.put(tensors)
        self.sent = tensors  # kept alive until the next request, as a producer must for CUDA IPC
        return t0

    def copy(self) -> int:
        torch = self.torch
        t0 = time.perf_counter_ns()
        dst = [torch.empty_like(s) for s in self.src]
        for d, s in zip(dst, self.src, strict=True):
            d.copy_(s)
        self.sync()
        return time.perf_counter_ns() - t0

    def pinned_copy(self) -> int:
        torch = self.torch
        t0 = time.perf_counter_ns()
        for p, s in zip(self.pinned, self.src, strict=True):
            p.copy_(s, non_blocking=True)
        dst = [torch.empty_like(s) for s in self.src]
        for d, p in zip(dst, self.pinned, strict=True):
            d.copy_(p, non_blocking=True)
        self.sync()
        return time.perf_counter_ns() - t0

    # consumer ----------------------------------------------------------------------------------------------

    def claim(self, variant: str, request_id: str, marker: float) -> tuple[dict[str, int], bool]:
        """The consumer's side; returns its instants: claim returned, table enqueued, landed, confirmed."""
        client = self.clients[variant]
        self.ready.set()
        got = client.claim(request_id, timeout_s=60)
        claimed = time.perf_counter_ns()
        table = self.arena.block_table(got.ids)
        enqueued = time.perf_counter_ns()
        self.sync()
        landed = time.perf_counter_ns()
        client.confirm()
        confirmed = time.perf_counter_ns()
        ok = (
            got.direct == (variant == "pool-direct")
            and all(float(m.item()) == marker for m in self.marks(got.block_ids))
            and table.tolist() == self.arena.local_ids(got.block_ids)
        )
        client.free(got.ids)
        times = {"claimed": claimed, "enqueued": enqueued, "landed": landed}
        if got.direct:
            times["confirmed"] = confirmed
        return times, ok

    def get(self, marker: float) -> tuple[int, bool]:
        tensors = self.queue.get(timeout=120)
        self.sync()
        t1 = time.perf_counter_ns()
        ok = len(tensors) == self.num_tensors and all(float(t[0].item()) == marker for t in (tensors[0], tensors[-1]))
        del tensors
        return t1, ok


def actor_main(
    role: str, conn: Any, url: str, device: str, queue: Any, ready: Any, lead_s: float, spin_s: float
) -> None:
    """A process's loop: run the method named by each command and send back what it returned (or the error)."""
    actor = Actor(role, url, device, queue, ready, lead_s, spin_s)
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            name, *params = msg
            try:
                conn.send(("ok", getattr(actor, name)(*params)))
            except Exception as exc:
                conn.send(("error", f"{role}.{name}: {type(exc).__name__}: {exc}"))
    finally:
        actor.close()


class Peer:
    """The parent's handle on one of the two processes."""

    def __init__(self, ctx: Any, role: str, url: str, device: str, queue: Any, ready: Any, *timing: float) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        args = (role, child, url, device, queue, ready, *timing)
        self.proc = ctx.Process(target=actor_main, args=args, daemon=True)
        self.proc.start()

    def started(self) -> None:
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError(f"the {self.role} process did not start")

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def reply(self, timeout_s: float = 600) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the {self.role} process did not answer within {timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, *msg: Any) -> Any:
        self.send(*msg)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        harness.wait_children([self.proc])
