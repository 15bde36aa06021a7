"""flood: token holders' latency on the pool's Unix socket while someone without the token floods it.

One pool with a token. A token holder times alloc + free pairs over the Unix socket, over HTTP and over the fast
channel, for each attack on a quiet pool and under the attack (the same run, the same pool), in ``--rounds``
alternating quiet and attacked stretches: on a machine shared with other work, the load beside the run then weighs
on both alike:

  pipelined   ``--connections`` TCP connections (no token), each writing ``GET /health`` requests pipelined as fast
              as the pool reads them (a first write of ``--pipelined`` of them) and reading the answers
  stalled     ``--connections`` fast-channel connections that said hello, each sending one frame's length (the
              largest frame) and nothing more

The pipelining attacker runs at nice 19: on a machine of few cores its own work would otherwise take the token
holders' CPU, which no pool can give back; what is measured is what the pool does for them. It reports each
phase's p50 and p99 and the pool's peak resident memory, and checks the goal of issue 46: the token holders' p99
under attack within 2x of the quiet run's, the pool's memory bounded by its caps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine
from kvpool.channel import HEADER, FastConnection
from kvpool.errors import KvpoolError
from kvpool.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")
TOKEN = "flood-bench-token"
GOAL_RATIO = 2.0
HEALTH = b"GET /health HTTP/1.1\r\nhost: kvpool\r\n\r\n"
ATTACKS = ("pipelined", "stalled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=None, help="attacking connections [100]")
    parser.add_argument("--pipelined", type=int, default=7000, help="requests in a connection's first write [7000]")
    parser.add_argument("--calls", type=int, default=None, help="timed alloc + free pairs per phase [1000]")
    parser.add_argument(
        "--once", action="store_true", help="each attacking connection writes its first requests only (issue 46's "
        "attack; a pool that parses whatever comes can be run against it without being killed for its memory)"
    )  # fmt: skip


def _pipeline(port: int, connections: int, first: int, once: bool, stop: Any, started: Any) -> None:
    """The pipelining attacker (its own process): write requests whenever the socket takes them, read answers."""
    os.nice(19)  # its own CPU is not what is measured: on a machine of few cores it would be the token holders'
    sel = selectors.DefaultSelector()
    burst = HEALTH * first
    more = b"" if once else HEALTH * 256
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, [memoryview(burst)])
    started.set()
    while not stop.is_set():
        for key, events in sel.select(0.1):
            s, pending = key.fileobj, key.data
            try:
                if events & selectors.EVENT_READ and not s.recv(1 << 16):  # type: ignore[union-attr]
                    sel.unregister(s)
                    continue
                if events & selectors.EVENT_WRITE and pending[0]:
                    sent = s.send(pending[0])  # type: ignore[union-attr]
                    pending[0] = pending[0][sent:] or memoryview(more)
                    if not pending[0]:
                        sel.modify(s, selectors.EVENT_READ, pending)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                sel.unregister(s)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(client: Any, calls: int) -> tuple[list[float], int]:
    """Alloc + free pairs: their durations, and how many the pool refused."""
    took, failed = [], 0
    for _ in range(calls):
        start = time.perf_counter()
        try:
            client.free(client.alloc(1))
        except KvpoolError:
            failed += 1
            continue
        took.append(time.perf_counter() - start)
    return took, failed


def _percentiles(timed: tuple[list[float], int]) -> dict[str, float]:
    ordered, failed = sorted(timed[0]) or [float("nan")], timed[1]
    return {
        "failed": failed,
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


class _Peak:
    """The pool's peak resident memory while it runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(args: argparse.Namespace) -> int:
    from kvpool.client import PoolClient

    device = machine.resolve_device(args)
    connections = args.connections or (20 if args.quick else 100)
    calls = args.calls or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 5)
    max_body = 16 << 20
    config = {"connections": connections, "pipelined": args.pipelined, "once": args.once, "calls": calls,
              "rounds": rounds}  # fmt: skip
    report = harness.Report("flood", args, device, config)
    flags = [*harness.layout_flags(LAYOUT), "--num-blocks", "256", "--token", TOKEN]
    with harness.servers(lambda: harness.start_pool(device, *flags)) as (pool,):
        pid = pool.proc.pid
        fast = PoolClient(pool.url, name="flood-fast", token=TOKEN, heartbeat=False)
        http = PoolClient(pool.url, name="flood-http", token=TOKEN, fast=False, heartbeat=False)
        _timed(fast, 100), _timed(http, 100)  # warm up
        for attack in ATTACKS:
            timed: dict[tuple[str, str], tuple[list[float], int]] = {}
            rss = {"quiet": 0, attack: 0}
            for _ in range(rounds):
                for phase in ("quiet", attack):
                    peak = _Peak(pid)
                    with _attack(phase, pool, connections, args, max_body):
                        time.sleep(1.0)  # the attack under way
                        for name, client in (("http", http), ("fast", fast)):
                            took, failed = _timed(client, -(-calls // rounds))
                            got = timed.setdefault((phase, name), ([], 0))
                            timed[(phase, name)] = (got[0] + took, got[1] + failed)
                    rss[phase] = max(rss[phase], peak.stop())
            for (phase, name), samples in timed.items():
                report.results.append(
                    {"attack": attack, "phase": phase, "transport": name, "rss": rss[phase], **_percentiles(samples)}
                )
        fast.close(), http.close()
    _targets(report)
    report.print_block("flood", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _plot(report: harness.Report) -> Any:
    """p99 of each token holder, quiet and under each attack, side by side."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['attack']}\n{r['phase']} {r['transport']}" for r in report.results]
    ax.bar(range(len(labels)), [r["p99_ms"] for r in report.results])
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set(ylabel="p99 of alloc + free (ms)", title="token holders on the Unix socket, quiet and under attack")
    return fig


class _attack:
    """The phase's attackers, started on entry and gone on exit."""

    def __init__(self, phase: str, pool: Any, connections: int, args: argparse.Namespace, max_body: int) -> None:
        self.phase, self.pool, self.n, self.args, self.max_body = phase, pool, connections, args, max_body
        self.proc: Any = None
        self.held: list[FastConnection] = []

    def __enter__(self) -> _attack:
        if self.phase == "pipelined":
            ctx = mp.get_context("spawn")
            self.stop, started = ctx.Event(), ctx.Event()
            self.proc = ctx.Process(
                target=_pipeline, args=(self.pool.port, self.n, self.args.pipelined, self.args.once, self.stop, started)
            )
            self.proc.start()
            started.wait(60)
        elif self.phase == "stalled":
            for _ in range(self.n):
                conn = FastConnection(f"{self.pool.socket}.fast", timeout_s=10)
                assert conn.call(b"hello", json.dumps({"token": TOKEN}).encode())[0] == 200
                conn.sock.sendall(HEADER.pack(self.max_body))
                self.held.append(conn)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop.set()
            self.proc.join(10)
            if self.proc.is_alive():
                os.kill(self.proc.pid, 9)
        for conn in self.held:
            conn.close()


def _targets(report: harness.Report) -> None:
    for attack in ATTACKS:
        rows = {(r["phase"], r["transport"]): r for r in report.results if r["attack"] == attack}
        for transport in ("http", "fast"):
            quiet, hit = rows[("quiet", transport)], rows[(attack, transport)]
            ratio = hit["p99_ms"] / quiet["p99_ms"] if not hit["failed"] else float("inf")
            report.targets.append(
                harness.Target(
                    f"{attack}: {transport} p99 under attack / quiet",
                    f"<= {GOAL_RATIO:g}x",
                    f"{ratio:.2f}x ({hit['p99_ms']:.2f} / {quiet['p99_ms']:.2f} ms, {hit['failed']} refused)",
                    ratio <= GOAL_RATIO,
                )
            )


def _body(report: harness.Report) -> str:
    rows = [
        [r["attack"], r["phase"], r["transport"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['max_ms']:.2f}",
         r["failed"], harness.fmt_bytes(r["rss"])]
        for r in report.results
    ]  # fmt: skip
    headers = ["attack", "phase", "token holder", "p50 ms", "p99 ms", "max ms", "refused", "pool peak RSS"]
    return harness.table(headers, rows)
