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
* a paused pool (one it started: SIGSTOPped for ``--pause-s``, past the lease, every ``--pause-every`` seconds, then
  SIGCONTed) expires nobody: its clients heartbeat all along, so no client's session may be lost (each one lost is
  counted, and a violation);
* stale ids: each client also frees, commits or hands off ids it let go of (their blocks freed and handed out again
  meanwhile, or not), alone or beside one it holds; the pool must refuse every such call whole (409), and the
  books and every later check above must not notice;
* direct handoffs: the fast-channel clients have inboxes, and half the handoffs are addressed to one of them, so
  their ids go producer to consumer while ownership moves in the pool; every claim checks what it got;
* with ``--slabs``, those clients also have reservation slabs: their allocs and frees stay local, handoffs among
  them go slab to slab, a full pool asks them for their idle blocks back, and the killed workers hand blocks from
  their own slab to one of them before they die: a first one as a datagram and, once that client read it, two more
  through their ring, which the client may not have read when the worker is killed (the pool then parks them for
  it); the client claims each by its request id;
* the books while the clients run, not only at the end: every ``--books-interval`` seconds each client in turn is
  paused between two operations and says what it holds (its refs, its slab's idle and unsettled handed blocks, the
  handoffs its slab box took for later), and every block the pool's books say its session holds
  (``GET /sessions/{id}/blocks``) must be among them: a block held by a live session that does not know of it is
  *stranded* (it would stay held until the session ends), a violation once it is still there half a second later
  with the client still paused;
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
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvpool.benchmarks import harness, machine
from kvpool.benchmarks.soak_client import (
    Client,
    DroppedHandoffs,
    Shared,
    Tally,
    family_tokens,
)
from kvpool.benchmarks.soak_report import plot, print_summary, summarize
from kvpool.client import PoolClient, http_client
from kvpool.errors import HandoffNotFound, HandoffRefused, KvpoolError, PoolExhausted
from kvpool.ids import block_of
from kvpool.slab import SlabClient, SlabConfig

SMALL_LAYOUT = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "4",
                "--dtype", "float32"]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load [60]")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (threads) [16]")
    parser.add_argument("--url", default=None, help="an idle pool to soak (unix:// or loopback http://); "
                        "default: start one")  # fmt: skip
    parser.add_argument("--num-blocks", type=int, default=128, help="blocks of the pool it starts [128]")
    parser.add_argument("--lease-ttl-s", type=float, default=3.0, help="lease of the pool it starts [3]")
    parser.add_argument("--host-blocks", type=int, default=0, help="host tier of the pool it starts, blocks [0: none]")
    parser.add_argument("--handoff-ttl-s", type=float, default=2.0, help="ttl_s of every handoff it parks [2]")
    parser.add_argument("--sample-interval", type=float, default=0.2, help="seconds between /stats samples [0.2]")
    parser.add_argument("--books-interval", type=float, default=1.0,
                        help="seconds between checks of each live client's books against the pool's [1]")  # fmt: skip
    parser.add_argument("--crash-every", type=float, default=1.5,
                        help="seconds between killed workers (0: none) [1.5]")  # fmt: skip
    parser.add_argument("--no-verify-data", action="store_true", help="do not map the arena to stamp and check bytes")
    parser.add_argument("--pause-every", type=float, default=12.0,
                        help="seconds between pauses of the pool it starts (0: none) [12]")  # fmt: skip
    parser.add_argument("--pause-s", type=float, default=None,
                        help="how long each pause lasts [1.5 leases]")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the summary alone here")
    parser.add_argument(
        "--slabs",
        action="store_true",
        help="start the pool with --slabs and give the fast-channel "
        "clients and the killed workers a small slab each (alloc, free, handoffs between them local)",
    )


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


def check_books(url: str, token: str | None, clients: list[Client], tally: Tally, stop: threading.Event,
                interval: float) -> None:  # fmt: skip
    """Every ``interval`` seconds, each live client in turn: paused between two operations, every block the pool's
    books put in its session must be one it knows it holds. One that is not, and still is not half a second later
    (the client still paused: a pipelined call the pool had not answered yet has settled by then), is stranded."""
    with http_client(url, token, 10.0) as http:
        while not stop.wait(interval):
            for client in clients:
                if stop.is_set():
                    return
                if not client.lock.acquire(timeout=2.0):
                    continue
                try:
                    slab = client.pool.slab
                    with slab.lock if slab is not None else contextlib.nullcontext():
                        if client.closed:
                            continue
                        stranded = _stranded(http, client)
                        if stranded:
                            time.sleep(0.5)
                            again = _stranded(http, client)
                            stranded = None if again is None else stranded & again
                        if stranded is None:
                            continue
                        with tally.lock:
                            tally.book_checks += 1
                            tally.stranded += sum(stranded.values())
                        if stranded:
                            tally.violation(
                                f"live books: client {client.index}'s session holds blocks "
                                f"{sorted(stranded.elements())[:8]} it does not know it holds (stranded)"
                            )
                except httpx.HTTPError as exc:
                    tally.violation(f"live books: GET /sessions/{{id}}/blocks unreachable: {exc}")
                finally:
                    client.lock.release()


def _stranded(http: httpx.Client, client: Client) -> collections.Counter[int] | None:
    """Blocks (a count per ref) the pool's books put in the client's session beyond what the client knows it holds;
    None if its session is gone."""
    r = http.get(f"/sessions/{client.pool.session_id}/blocks")
    if r.status_code == 404:
        return None
    r.raise_for_status()
    held = collections.Counter(block_of(i) for i in r.json()["block_ids"])
    return held - client.known()


def check_balance(stats: dict[str, Any], tally: Tally, when: str) -> None:
    with tally.lock:
        tally.samples += 1
        tally.max_in_use = max(tally.max_in_use, stats["in_use"])
    for tier, t in [("", stats), *stats.get("tiers", {}).items()]:  # the whole pool, then each tier of it
        free, in_use, cached, total = t["free"], t["in_use"], t["cached"], t["num_blocks"]
        fenced = t.get("quarantined", 0)  # held back from a lapsed session's live process
        if free + in_use + cached + fenced != total or min(free, in_use, cached, fenced) < 0:
            books = f"the {tier} tier's books" if tier else "books"
            tally.violation(f"{when}: {books} do not balance: free {free} + in_use {in_use} + cached {cached} + "
                            f"quarantined {fenced} != {total}")  # fmt: skip


def crash_worker_main(url: str, block_size: int, ttl_s: float, to: str | None = None) -> int:
    """The doomed worker (run in a subprocess): take blocks, prefix refs and a parked handoff, then wait.

    With ``to`` (a client with a slab), it also hands blocks from its own slab straight to that client, each
    announced on a line ``handed REQUEST_ID`` so that the soak has ``to`` claim it: first one as a datagram, then,
    once ``to`` read it (it reads this worker's ring from then on), two through its ring. Once this worker is
    killed, what ``to`` took is its own, what it had not read is parked for it (the ring's) or left in its slab box
    (the datagram), and all of it comes back if ``to`` is gone too."""
    client = None
    with contextlib.suppress(KvpoolError):
        client = (SlabClient if to is not None else PoolClient)(url, name="soak-doomed", role="prefill")
        with contextlib.suppress(PoolExhausted):
            ids = client.alloc(2)
            client.handoff(f"doomed-{os.getpid()}", ids[:1], num_tokens=1, ttl_s=ttl_s)
            if to is not None:
                slab_handoff(client, f"doomed-slab-{os.getpid()}-0", ids[1:], to)
                if read_by(client, to, within_s=2.0):
                    for k in (1, 2):
                        slab_handoff(client, f"doomed-slab-{os.getpid()}-{k}", client.alloc(1), to)
        client.lookup(family_tokens(0, block_size))
    print("ready", flush=True)
    # Killed while these are in flight: with a host tier, some land while the pool copies the prefix back for it.
    if client is not None:
        with contextlib.suppress(KvpoolError):
            for family in range(1, 5):
                client.lookup(family_tokens(family, block_size))
    while True:
        time.sleep(3600)


def slab_handoff(client: SlabClient, request_id: str, ids: list[int], to: str) -> None:
    client.handoff(request_id, ids, num_tokens=1, to=to)
    print(f"handed {request_id}", flush=True)


def read_by(client: SlabClient, to: str, within_s: float) -> bool:
    """Whether ``to`` reads this client's ring (it took a handoff from it), waiting up to ``within_s``."""
    slab, sender = client.slab, getattr(client, "slab_sender", None)  # a client made with a slab has one
    peer = sender.peers.get(to) if sender is not None else None
    if slab is None or peer is None:
        return False
    deadline = time.monotonic() + within_s
    while slab.view.all_words[peer.watch] != slab.info.nonce:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill_workers(url: str, block_size: int, ttl_s: float, every: float, tally: Tally, stop: threading.Event,
                 shared: Shared, slab_to: list[int] | None = None) -> None:  # fmt: skip
    """Every ``every`` seconds, start a worker, wait until it holds its refs, and SIGKILL it. With ``slab_to`` the
    workers have slabs, and hand blocks to one of those clients before they die, which then claims them."""
    env = harness.child_env({"KVPOOL_SLAB_BLOCKS": "4"} if slab_to else None)
    rng = random.Random(len(slab_to or ()))
    while not stop.wait(every):
        cmd = [sys.executable, "-m", "kvpool.benchmarks.soak", "--crash-worker", url, str(block_size), str(ttl_s)]
        to = rng.choice(slab_to) if slab_to else None
        cmd += [f"soak-{to}"] if to is not None else []
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                cwd=machine.ROOT, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None
            while (line := proc.stdout.readline().strip()).startswith("handed "):
                shared.park(line.split()[1], to)
            ready = line == "ready"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if ready:
            with tally.lock:
                tally.crashed += 1
        else:
            tally.violation("a crash worker died before it was ready")


def pause_pool(pid: int, every: float, pause_s: float, tally: Tally, stop: threading.Event) -> None:
    """Every ``every`` seconds, stop the pool's process for ``pause_s`` (SIGSTOP, as a debugger, a frozen cgroup or
    swap would), then let it go on."""
    while not stop.wait(every):
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(pause_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        with tally.lock:
            tally.pauses += 1


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
            *SMALL_LAYOUT, *(["--slabs", "--slab-max-blocks", "16"] if args.slabs else [])]  # fmt: skip
    if args.host_blocks:
        argv += ["--host-blocks", str(args.host_blocks)]
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
        shared.slab = SlabConfig(blocks=4, low=1, high=8) if args.slabs else None
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
        shared.stopped = threading.Barrier(len(clients))
        stop, side_stop = threading.Event(), threading.Event()
        threads = [threading.Thread(target=c.run, args=(stop,), name=f"soak-{c.index}") for c in clients]
        side = [threading.Thread(target=sample_books, args=(url, token, tally, side_stop, args.sample_interval))]
        if args.books_interval > 0:
            books_args = (url, token, clients, tally, stop, args.books_interval)
            side.append(threading.Thread(target=check_books, args=books_args))
        if args.crash_every > 0:
            slab_to = shared.addressable if args.slabs else None
            kill_args = (url, shared.block_size, args.handoff_ttl_s, args.crash_every, tally, side_stop, shared,
                         slab_to)  # fmt: skip
            side.append(threading.Thread(target=kill_workers, args=kill_args))
        if args.pause_every > 0 and server is not None:  # never someone else's pool
            pause_s = args.pause_s if args.pause_s is not None else 1.5 * args.lease_ttl_s
            pause_args = (server.proc.pid, args.pause_every, pause_s, tally, side_stop)
            side.append(threading.Thread(target=pause_pool, args=pause_args))
        dropped = DroppedHandoffs(tally)
        logging.getLogger("kvpool.slab.box").addHandler(dropped)
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
        logging.getLogger("kvpool.slab.box").removeHandler(dropped)
        side_stop.set()
        for t in side:
            t.join(timeout=60)
        # Claim what the clients left parked, then give the killed workers' leases and handoffs time to run out. What
        # was addressed to a client that has closed was refused and released with its session: no one can claim it.
        with PoolClient(url, name="soak-drain") as drain:
            for request_id in shared.drain():
                with contextlib.suppress(HandoffNotFound, HandoffRefused):
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
    names = (
        "duration",
        "clients",
        "url",
        "num_blocks",
        "lease_ttl_s",
        "handoff_ttl_s",
        "sample_interval",
        "books_interval",
        "crash_every",
        "seed",
        "host_blocks",
        "slabs",
        "pause_every",
        "pause_s",
    )
    config = {k: getattr(args, k) for k in names}
    report = harness.Report("soak", args, machine.Device("cpu"), config)
    ops, rates = summary["ops"], summary["ops_per_s"]
    report.results = [{"op": k, "count": ops[k], "ops_per_s": rates[k]} for k in ops]
    report.raw = {"summary": summary, "in_use": tally.in_use}
    report.save(lambda: plot(summary, tally.in_use))
    return 1 if tally.violation_count else 0


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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--crash-worker"]:
        return crash_worker_main(argv[1], int(argv[2]), float(argv[3]), argv[4] if len(argv) > 4 else None)
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
