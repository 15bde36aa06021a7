"""Soak: many concurrent clients doing random alloc, free, commit, lookup, handoff and claim against one pool,
with workers killed on the side, checking at every step that nothing is lost and nobody is handed memory in use.

``python -m kvpool.benchmarks.soak [--duration 60] [--clients 16] [--url URL]`` (or ``kvpool bench soak ...``).
Without ``--url`` it starts its own pool (CPU backend, loopback TCP and a Unix socket in a private temporary
directory) and stops it afterwards; with ``--url`` it only ever talks to a ``unix://`` socket or a loopback
``http://`` address, and expects that pool to be otherwise idle (its books must come back to where they were).

What it checks, and exits non-zero on:

* every ``/stats`` sample balances: ``free + in_use + cached == num_blocks``;
* no 5xx (507 "pool exhausted" from alloc is the contract's answer to a full pool, counted but not a fault) and
  no error a correct client cannot cause (409 on a block it holds, 404 on its live session, ...);
* the bytes: each client stamps the blocks it allocates and checks the stamp before it frees or hands them off
  (nobody else wrote into a block it held), each committed block carries a stamp derived from its tokens that
  every prefix hit and every claim checks (a hit never hands back other tokens' KV);
* killed workers (a subprocess SIGKILLed while holding blocks, prefix refs and a parked handoff) lose nothing;
* direct handoffs: the fast-channel clients have inboxes, and half the handoffs are addressed to one of them, so
  their ids go producer to consumer while ownership moves in the pool; every claim checks what it got;
* at the end, after every client closed: nothing in use, no handoff parked, no session left.

It shows its progress, prints ops/s by kind and errors by kind, and writes JSON and a PNG into ``--out`` like
every suite (``--json PATH`` also writes the summary alone there).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from kvpool.benchmarks import harness, machine

from kvpool.client import PoolClient, http_client
from kvpool.errors import HandoffNotFound, KvpoolError, PoolExhausted

OPS = ("alloc", "free", "commit", "lookup", "handoff", "claim")
WEIGHTS = (24, 20, 12, 18, 12, 14)
FAMILIES = 6  # prompt families whose prefixes clients share
FAMILY_BLOCKS = 8  # full blocks per family prompt
MAX_REFS = 12  # a client frees before it holds more refs than this
SMALL_LAYOUT = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "4",
                "--dtype", "float32"]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load [60]")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (threads) [16]")
    parser.add_argument("--url", default=None, help="an idle pool to soak (unix:// or loopback http://); "
                        "default: start one")  # fmt: skip
    parser.add_argument("--num-blocks", type=int, default=128, help="blocks of the pool it starts [128]")
    parser.add_argument("--lease-ttl-s", type=float, default=3.0, help="lease of the pool it starts [3]")
    parser.add_argument("--handoff-ttl-s", type=float, default=2.0, help="ttl_s of every handoff it parks [2]")
    parser.add_argument("--sample-interval", type=float, default=0.2, help="seconds between /stats samples [0.2]")
    parser.add_argument("--crash-every", type=float, default=1.5,
                        help="seconds between killed workers (0: none) [1.5]")  # fmt: skip
    parser.add_argument("--no-verify-data", action="store_true", help="do not map the arena to stamp and check bytes")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary alone here")


# -- what the run records -----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts shared by every thread (under one lock: the counts are tiny next to a pool round trip)."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    samples: int = 0
    max_in_use: int = 0
    in_use: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the start, blocks in use)
    t0: float = field(default_factory=time.monotonic)
    crashed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def op(self, kind: str) -> None:
        with self.lock:
            self.ops[kind] += 1

    def error(self, kind: str, exc: BaseException) -> None:
        with self.lock:
            self.errors[f"{kind} {type(exc).__name__}"] += 1

    def violation(self, message: str) -> None:
        with self.lock:
            self.violation_count += 1
            if len(self.violations) < 50:
                self.violations.append(message)


# -- the bytes: stamps that prove who wrote a block ---------------------------------------------------------


def content_stamp(family: int, position: int) -> int:
    """The stamp of the block at ``position`` of ``family``'s prompt: the same for every client that writes it."""
    return (1 << 60) | (family << 20) | position


def family_tokens(family: int, block_size: int) -> list[int]:
    return [(family * 7919 + k * 104729) % 50000 for k in range(FAMILY_BLOCKS * block_size)]


class Stamps:
    """Reads and writes 8 bytes at the start of a block's first K view (its own bytes in either layout)."""

    def __init__(self, arena: Any | None) -> None:
        self.arena = arena

    def _view(self, block: int) -> Any:
        import torch

        first = self.arena.block(block)[0]
        return first.reshape(-1).view(torch.uint8)[:8].view(torch.int64)

    def write(self, block: int, stamp: int) -> None:
        if self.arena is not None:
            self._view(block)[0] = stamp

    def read(self, block: int) -> int | None:
        return None if self.arena is None else int(self._view(block)[0])


# -- one client ---------------------------------------------------------------------------------------------


@dataclass
class Ref:
    block: int
    kind: str  # "own": allocated by this client, nobody else holds it; "content": committed, shareable;
    # "foreign": claimed from a handoff this run did not stamp (a killed worker's): held, not checked
    stamp: int | None


class Client:
    """One session doing random operations and checking what it gets back."""

    def __init__(self, index: int, url: str, fast: bool, shared: Shared) -> None:
        self.index = index
        self.shared = shared
        self.rng = random.Random(shared.seed * 1000 + index)
        self.pool = PoolClient(url, name=f"soak-{index}", role="other", fast=fast, inbox=fast)
        self.stamps = Stamps(self.pool.arena() if shared.verify_data else None)
        self.refs: list[Ref] = []
        self.seq = 0

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                kind = self.rng.choices(OPS, WEIGHTS)[0]
                if len(self.refs) > MAX_REFS:
                    kind = "free"
                self.step(kind)
            self.release_all()
        except Exception:
            self.shared.tally.violation(f"client {self.index} crashed: {traceback.format_exc(limit=6)}")
        finally:
            with contextlib.suppress(Exception):
                self.pool.close()

    def step(self, kind: str) -> None:
        tally = self.shared.tally
        try:
            if getattr(self, f"do_{kind}")():  # False: nothing to do it on (no refs held, nothing parked)
                tally.op(kind)
        except PoolExhausted as exc:  # the contract's answer to a full pool: make room
            tally.error(kind, exc)
            if kind != "alloc":
                tally.violation(f"{kind} answered pool exhausted: {exc}")
            self.free_some()
        except HandoffNotFound as exc:  # expired, or taken first by a claim of "the oldest"
            tally.error(kind, exc)
            if kind != "claim":
                tally.violation(f"{kind} answered handoff not found: {exc}")
        except KvpoolError as exc:  # nothing else can happen to a correct client of a correct pool
            tally.error(kind, exc)
            tally.violation(f"client {self.index} {kind}: {type(exc).__name__} (status {exc.status}): {exc}")

    def check(self, ref: Ref, what: str) -> None:
        if ref.stamp is None:
            return
        got = self.stamps.read(ref.block)
        if got is not None and got != ref.stamp:
            self.shared.tally.violation(
                f"client {self.index} {what}: block {ref.block} holds stamp {got:#x}, expected {ref.stamp:#x} "
                f"({ref.kind}): someone wrote into a block this client held"
            )

    def take(self, k: int) -> list[Ref]:
        picked = self.rng.sample(range(len(self.refs)), min(k, len(self.refs)))
        return [self.refs[i] for i in sorted(picked)]

    def drop(self, refs: Sequence[Ref]) -> None:
        gone = {id(r) for r in refs}
        self.refs = [r for r in self.refs if id(r) not in gone]

    # -- operations -------------------------------------------------------------------------------------

    def do_alloc(self) -> bool:
        for block in self.pool.alloc(self.rng.randint(1, 4)):
            self.seq += 1
            stamp = (self.index + 1) << 40 | self.seq
            self.stamps.write(block, stamp)
            self.refs.append(Ref(block, "own", stamp))
        return True

    def do_free(self) -> bool:
        refs = self.take(self.rng.randint(1, 4))
        if not refs:
            return False
        for ref in refs:
            self.check(ref, "before free")
        freed = self.pool.free([r.block for r in refs])
        self.drop(refs)
        if freed != len(refs):
            self.shared.tally.violation(f"free of {len(refs)} refs answered freed={freed}")
        return True

    def do_commit(self) -> bool:
        own = [r for r in self.refs if r.kind == "own"]  # commit only blocks this client wrote
        if not own:
            return False
        family = self.rng.randrange(FAMILIES)
        n = self.rng.randint(1, min(len(own), FAMILY_BLOCKS))
        chain = own[:n]
        for ref in chain:
            self.check(ref, "before commit")
        bs = self.shared.block_size
        for position, ref in enumerate(chain):
            ref.kind, ref.stamp = "content", content_stamp(family, position)
            self.stamps.write(ref.block, ref.stamp)
        result = self.pool.commit([r.block for r in chain], family_tokens(family, bs)[: n * bs])
        if result.num_blocks != n or result.committed + result.duplicates != n:
            self.shared.tally.violation(f"commit of {n} blocks answered {result}")
        return True

    def do_lookup(self) -> bool:
        family = self.rng.randrange(FAMILIES)
        bs = self.shared.block_size
        length = self.rng.randint(1, FAMILY_BLOCKS * bs + bs - 1)
        hit = self.pool.lookup(family_tokens(family, bs)[:length])
        if hit.num_tokens != len(hit.block_ids) * bs or hit.num_tokens > length:
            self.shared.tally.violation(f"lookup answered {hit.num_tokens} tokens for {len(hit.block_ids)} blocks")
        for position, block in enumerate(hit.block_ids):
            ref = Ref(block, "content", content_stamp(family, position))
            self.check(ref, f"prefix hit of family {family} position {position}")
            self.refs.append(ref)
        return True

    def do_handoff(self) -> bool:
        refs = self.take(self.rng.randint(1, 3))
        if not refs:
            return False
        for ref in refs:
            self.check(ref, "before handoff")
        self.seq += 1
        request_id = f"soak-{self.index}-{self.seq}"
        meta = {"refs": [[r.block, r.kind, r.stamp] for r in refs]}
        num_tokens = self.rng.randint(0, len(refs) * self.shared.block_size)
        to = None
        if self.shared.addressable and self.rng.random() < 0.5:
            to = self.rng.choice(self.shared.addressable)
        ttl_s = self.shared.handoff_ttl_s
        blocks = [r.block for r in refs]
        self.pool.handoff(request_id, blocks, num_tokens, meta, ttl_s=ttl_s, to=None if to is None else f"soak-{to}")
        self.drop(refs)
        self.shared.park(request_id, to)
        return True

    def do_claim(self) -> bool:
        request_id = self.shared.unpark(self.rng, self.index)
        if request_id is None and self.rng.random() < 0.8:
            return False
        got = self.pool.claim(request_id, timeout_s=0.05 if request_id is None else 0.2)
        if got.direct:  # the ids came from the producer: trust them once the pool has confirmed the claim
            self.pool.confirm()
            self.shared.tally.op("claim, delivered directly")
        if "refs" not in got.meta:  # a killed worker's handoff, taken by a claim of "the oldest"
            self.refs.extend(Ref(b, "foreign", None) for b in got.block_ids)
            return True
        refs = [Ref(int(b), str(k), None if s is None else int(s)) for b, k, s in got.meta["refs"]]
        if [r.block for r in refs] != got.block_ids:
            self.shared.tally.violation(f"claim of {got.request_id} answered blocks {got.block_ids}, parked {refs}")
        for ref in refs:
            self.check(ref, f"after claim of {got.request_id}")
        self.refs.extend(refs)
        return True

    def free_some(self) -> None:
        if self.refs:
            self.do_free()

    def release_all(self) -> None:
        while self.refs:
            self.do_free()


# -- what the clients share ---------------------------------------------------------------------------------


@dataclass
class Shared:
    tally: Tally
    block_size: int
    handoff_ttl_s: float
    seed: int
    verify_data: bool
    addressable: list[int] = field(default_factory=list)  # clients with an inbox
    parked: list[tuple[str, int | None]] = field(default_factory=list)  # (request id, the client it is for)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def park(self, request_id: str, to: int | None) -> None:
        with self.lock:
            self.parked.append((request_id, to))

    def unpark(self, rng: random.Random, me: int) -> str | None:
        """A parked request this client may claim: one for anyone, or one addressed to it."""
        with self.lock:
            mine = [i for i, (_, to) in enumerate(self.parked) if to is None or to == me]
            if not mine:
                return None
            return self.parked.pop(rng.choice(mine))[0]

    def drain(self) -> list[str]:
        with self.lock:
            ids, self.parked = [r for r, _ in self.parked], []
            return ids


# -- the side jobs: sampling the books, killing workers -----------------------------------------------------


def sample_books(url: str, token: str | None, tally: Tally, stop: threading.Event, interval: float) -> None:
    """GET /stats (and now and then /metrics) until stopped; every sample must balance and none may be a 5xx."""
    with http_client(url, token, 10.0) as http:
        n = 0
        while not stop.wait(interval):
            n += 1
            try:
                r = http.get("/stats")
                if r.status_code != 200:
                    tally.violation(f"/stats answered {r.status_code}: {r.text[:200]}")
                    continue
                stats = r.json()
                check_balance(stats, tally, "sample")
                with tally.lock:
                    tally.in_use.append((round(time.monotonic() - tally.t0, 2), int(stats["in_use"])))
                if n % 10 == 0:
                    m = http.get("/metrics")
                    if m.status_code != 200 or "kvpool_" not in m.text:
                        tally.violation(f"/metrics answered {m.status_code}")
            except httpx.HTTPError as exc:
                tally.violation(f"/stats unreachable: {exc}")


def check_balance(stats: dict[str, Any], tally: Tally, when: str) -> None:
    free, in_use, cached, total = stats["free"], stats["in_use"], stats["cached"], stats["num_blocks"]
    with tally.lock:
        tally.samples += 1
        tally.max_in_use = max(tally.max_in_use, in_use)
    if free + in_use + cached != total or min(free, in_use, cached) < 0:
        tally.violation(f"{when}: books do not balance: free {free} + in_use {in_use} + cached {cached} != {total}")


def crash_worker_main(url: str, block_size: int, ttl_s: float) -> int:
    """The doomed worker (run in a subprocess): take blocks, prefix refs and a parked handoff, then wait."""
    with contextlib.suppress(KvpoolError):
        client = PoolClient(url, name="soak-doomed", role="prefill")
        with contextlib.suppress(PoolExhausted):
            ids = client.alloc(2)
            client.handoff(f"doomed-{os.getpid()}", ids[:1], num_tokens=1, ttl_s=ttl_s)
        client.lookup(family_tokens(0, block_size))
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def kill_workers(url: str, block_size: int, ttl_s: float, every: float, tally: Tally, stop: threading.Event) -> None:
    """Every ``every`` seconds, start a worker, wait until it holds its refs, and SIGKILL it."""
    while not stop.wait(every):
        cmd = [sys.executable, "-m", "kvpool.benchmarks.soak", "--crash-worker", url, str(block_size), str(ttl_s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=harness.child_env(),
                                cwd=harness.ROOT, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None
            ready = proc.stdout.readline().strip() == "ready"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if ready:
            with tally.lock:
                tally.crashed += 1
        else:
            tally.violation("a crash worker died before it was ready")


# -- the run ------------------------------------------------------------------------------------------------


def check_local(url: str) -> None:
    """Refuse anything but a Unix socket or a loopback address: a soak is load, never aimed at someone else."""
    if url.startswith("unix://"):
        return
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "http" and (host == "localhost" or _is_loopback(host)):
        return
    raise SystemExit(f"soak: refusing {url!r}: give a unix:// socket or a loopback http:// address")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def pool_under_test(args: argparse.Namespace) -> Iterator[tuple[str, str | None, harness.Server | None]]:
    """(url for the clients, TCP url for some of them or None, the server if this run started it)."""
    if args.url:
        check_local(args.url)
        yield args.url, (args.url if args.url.startswith("http") else None), None
        return
    argv = ["kvpool", "serve", "--backend", "cpu", "--log-level", "warning", "--num-blocks", str(args.num_blocks),
            "--lease-ttl-s", str(args.lease_ttl_s), "--handoff-ttl-s", str(args.handoff_ttl_s),
            *SMALL_LAYOUT]  # fmt: skip
    server = harness.start_server("pool", argv, timeout_s=120)
    try:
        yield server.url, server.tcp_url, server
    finally:
        server.stop()


def run(args: argparse.Namespace) -> int:
    tally = Tally()
    token = os.environ.get("KVPOOL_TOKEN")
    with pool_under_test(args) as (url, tcp_url, server):
        with http_client(url, token, 10.0) as http:
            start = http.get("/stats").json()
            layout = http.get("/arena").json()["layout"]
        check_balance(start, tally, "start")
        shared = Shared(tally, int(layout["block_size"]), args.handoff_ttl_s, args.seed, not args.no_verify_data)
        # A quarter of the clients on plain HTTP over the Unix socket, a quarter over loopback TCP (when there is
        # one), the rest on the fast channel: all three transports carry the same calls into the same books.
        kinds = []
        for i in range(args.clients):
            if i % 4 == 2:
                kinds.append(("http-uds", url, False))
            elif i % 4 == 3 and tcp_url:
                kinds.append(("http-tcp", tcp_url, False))
            else:
                kinds.append(("fast", url, True))
        shared.addressable = [i for i, (_, _, fast) in enumerate(kinds) if fast]
        clients = [Client(i, u, fast, shared) for i, (_, u, fast) in enumerate(kinds)]
        stop, side_stop = threading.Event(), threading.Event()
        threads = [threading.Thread(target=c.run, args=(stop,), name=f"soak-{c.index}") for c in clients]
        side = [threading.Thread(target=sample_books, args=(url, token, tally, side_stop, args.sample_interval))]
        if args.crash_every > 0:
            side.append(threading.Thread(target=kill_workers, args=(url, shared.block_size, args.handoff_ttl_s,
                                                                    args.crash_every, tally, side_stop)))  # fmt: skip
        t0 = tally.t0 = time.monotonic()
        for t in threads + side:
            t.start()
        with harness.progress(max(1, round(args.duration)), "soak (s)", args.no_progress) as bar:
            while (left := t0 + args.duration - time.monotonic()) > 0:
                time.sleep(min(1.0, left))
                bar.update(1)
                with tally.lock:
                    bar.set_postfix_str(f"{sum(tally.ops.values())} ops, {tally.violation_count} violations")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        elapsed = time.monotonic() - t0
        side_stop.set()
        for t in side:
            t.join(timeout=60)
        # Claim what the clients left parked, then give the killed workers' leases and handoffs time to run out.
        with PoolClient(url, name="soak-drain") as drain:
            for request_id in shared.drain():
                with contextlib.suppress(HandoffNotFound):
                    drain.free(drain.claim(request_id, timeout_s=0).block_ids)
        with http_client(url, token, 10.0) as http:
            probe = http.post("/sessions", json={"name": "soak-probe"}).json()
            http.delete(f"/sessions/{probe['session_id']}")
            lease = float(probe["lease_ttl_s"])
            end = settle(http, start, lease + args.handoff_ttl_s + 2.0, tally)
        if server is not None and "Traceback" in server.output():
            tally.violation(f"the pool logged a traceback:\n{server.output()[-2000:]}")
    summary = summarize(args, tally, elapsed, kinds, start, end)
    print_summary(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    config = {k: getattr(args, k) for k in ("duration", "clients", "url", "num_blocks", "lease_ttl_s", "handoff_ttl_s",
                                            "sample_interval", "crash_every", "seed")}  # fmt: skip
    report = harness.Report("soak", args, machine.Device("cpu"), config)
    ops, rates = summary["ops"], summary["ops_per_s"]
    report.results = [{"op": k, "count": ops[k], "ops_per_s": rates[k]} for k in ops]
    report.raw = {"summary": summary, "in_use": tally.in_use}
    report.save(lambda: _plot(summary, tally.in_use))
    return 1 if tally.violation_count else 0


def _plot(summary: dict[str, Any], in_use: list[tuple[float, int]]) -> Any:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    kinds = list(summary["ops_per_s"])
    axes[0].bar(kinds, [summary["ops_per_s"][k] for k in kinds])
    axes[0].set(title=f"operations per second, {sum(summary['clients'].values())} clients", ylabel="ops/s")
    axes[0].tick_params(axis="x", labelrotation=25)
    axes[0].grid(True, axis="y", alpha=0.3)
    axes[1].plot([t for t, _ in in_use], [n for _, n in in_use], lw=1, label="in use")
    axes[1].axhline(summary["num_blocks"], color="grey", lw=0.8, ls="--", label="arena blocks")
    axes[1].set(title="blocks in use, sampled from /stats", xlabel="s", ylabel="blocks")
    axes[1].legend(fontsize=8)
    axes[1].grid(True, alpha=0.3)
    verdict = "PASS" if not summary["violations"] else f"FAIL ({summary['violations']} violations)"
    fig.suptitle(f"kvpool soak: {summary['duration_s']} s, workers killed: {summary['crashed_workers']}, {verdict}")
    return fig


def settle(http: httpx.Client, start: dict[str, Any], within_s: float, tally: Tally) -> dict[str, Any]:
    """Wait until the books are back where they started (in use, handoffs, sessions); every sample balances."""
    deadline = time.monotonic() + within_s
    while True:
        stats = http.get("/stats").json()
        check_balance(stats, tally, "end")
        back = all(stats[k] <= start[k] for k in ("in_use", "handoffs", "sessions"))
        if back or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for key in ("in_use", "handoffs", "sessions"):
        if stats[key] > start[key]:
            tally.violation(f"end: {key} is {stats[key]} ({start[key]} at the start) {within_s:.1f}s after the run")
    return stats


def summarize(args: argparse.Namespace, tally: Tally, elapsed: float, kinds: list[tuple[str, str, bool]],
              start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {
        "duration_s": round(elapsed, 2),
        "clients": dict(collections.Counter(k for k, _, _ in kinds)),
        "ops": {k: tally.ops[k] for k in [*OPS, *sorted(set(tally.ops) - set(OPS))]},
        "ops_per_s": {k: round(tally.ops[k] / elapsed, 1) for k in [*OPS, *sorted(set(tally.ops) - set(OPS))]},
        "errors": dict(tally.errors),
        "samples": tally.samples,
        "max_in_use": tally.max_in_use,
        "num_blocks": end["num_blocks"],
        "crashed_workers": tally.crashed,
        "end": {k: end[k] for k in ("free", "in_use", "cached", "handoffs", "sessions")},
        "start": {k: start[k] for k in ("free", "in_use", "cached", "handoffs", "sessions")},
        "violations": tally.violation_count,
        "violation_messages": tally.violations,
        "verify_data": not args.no_verify_data,
    }


def print_summary(s: dict[str, Any]) -> None:
    clients = ", ".join(f"{n} {k}" for k, n in s["clients"].items())
    lines = [f"kvpool soak: {s['duration_s']} s, {sum(s['clients'].values())} clients ({clients})", ""]
    kinds = [*OPS, *sorted(k for k in s["ops"] if k not in OPS)]
    lines.append(harness.table(["op", "count", "ops/s"], [[k, s["ops"][k], s["ops_per_s"][k]] for k in kinds]))
    lines.append("")
    total = sum(s["ops"].values())
    lines.append(f"total {total} ops, {total / max(s['duration_s'], 1e-9):.0f} ops/s")
    lines.append("errors by kind (507 on alloc and 404 on claim are expected; anything else is a violation):")
    lines += [f"  {k}: {n}" for k, n in sorted(s["errors"].items())] or ["  none"]
    lines.append(f"/stats samples: {s['samples']}, all balanced unless listed below; "
                 f"max in use {s['max_in_use']} of {s['num_blocks']}")  # fmt: skip
    lines.append(f"killed workers: {s['crashed_workers']}")
    lines.append(f"end: {s['end']} (start: {s['start']})")
    lines.append(f"violations: {s['violations']}")
    lines += [f"  - {m}" for m in s["violation_messages"]]
    lines.append("FAIL" if s["violations"] else "PASS")
    print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--crash-worker"]:
        return crash_worker_main(argv[1], int(argv[2]), float(argv[3]))
    parser = argparse.ArgumentParser(prog="kvpool bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    harness.add_output_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    harness.ARGV[:] = ["soak", *argv]
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients and --duration must be positive")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
