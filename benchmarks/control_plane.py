"""control-plane: /alloc + /free pair latency and block throughput, against the framework's and the books' floors.

Every variant runs the same loop (allocate a batch of blocks, free them, time the pair) in the same client
processes, interleaved round by round:

  pool-fast        PoolClient's default: the pool's fast channel (framed JSON on a kept-open Unix socket)
  pool-fast-spin   the same with ``reply_spin_s`` (200 us): the client polls for each answer before it sleeps
  pool-http-unix   PoolClient(fast=False): HTTP through httpx keep-alive over the pool's Unix socket
  pool-http-tcp    the same over loopback TCP
  bare-*           the same three transports against benchmarks/bare_server.py: the pool's routes and models with
                   nothing behind them, same uvicorn settings (the framework's floor)
  inproc           BlockAllocator.allocate/free called in the client process (the no-HTTP floor)

Batches of 1 to 1024 blocks, 1 to 16 concurrent client processes. Each chunk runs for a fixed time from a shared
start instant; throughput is the blocks allocated and freed by all clients over the chunk's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from array import array
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

POOL_VARIANTS = ("pool-fast", "pool-fast-spin", "pool-http-unix", "pool-http-tcp")
VARIANTS = (*POOL_VARIANTS, "bare-fast", "bare-http-unix", "bare-http-tcp", "inproc")
# A tiny arena (512-byte blocks): the control plane never touches KV bytes, so their size does not matter here.
POOL_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")
TARGET_FLOOR_RATIO = 1.5
TARGET_BLOCKS_PER_S = 1e6
GOAL_LABEL = f"goal {TARGET_BLOCKS_PER_S / 1e6:.0f}M blocks/s"
SPIN_S = 200e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=harness.int_list, default=None, help="blocks per call [1,16,128,1024]")
    parser.add_argument("--clients", type=harness.int_list, default=None, help="concurrent client processes [1,4,16]")
    parser.add_argument("--chunk-s", type=float, default=None, help="seconds each variant runs per round [0.25]")


def _client(conn: Any, urls: dict[str, tuple[str, bool, float]], inproc_blocks: int) -> None:
    """One client process: a PoolClient per transport and a private allocator; runs timed chunks on command."""
    from kvpool.client import PoolClient
    from kvpool.server.books.allocator import BlockAllocator

    clients = {
        name: PoolClient(url, name=f"bench-{name}", fast=fast, heartbeat=False, reply_spin_s=spin)
        for name, (url, fast, spin) in urls.items()
    }
    books = BlockAllocator(inproc_blocks)
    calls: dict[str, tuple[Any, Any]] = {name: (c.alloc, c.free) for name, c in clients.items()}
    calls["inproc"] = (lambda n: books.allocate("bench", n), lambda ids: books.free("bench", ids))
    conn.send("ready")
    clock = time.perf_counter_ns
    try:
        while (msg := conn.recv()) is not None:
            variant, batch, start_ns, duration_ns = msg
            alloc, free = calls[variant]
            free(alloc(batch))  # warm this connection after the previous chunk used another
            lat = array("q")
            while (wait := start_ns - clock()) > 2_000_000:
                time.sleep(wait / 2e9)
            while clock() < start_ns:
                pass
            end_ns, now = start_ns + duration_ns, clock()
            while True:
                t0 = now
                free(alloc(batch))
                now = clock()
                lat.append(now - t0)
                if now >= end_ns and len(lat) >= 3:
                    break
            conn.send((lat.tobytes(), now))
    finally:
        for c in clients.values():
            c.close()


def run(args: argparse.Namespace) -> int:
    device = machine.resolve_device(args)
    batches = args.batches or ([1, 64] if args.quick else [1, 16, 128, 1024])
    clients = args.clients or ([1, 2] if args.quick else [1, 4, 16])
    rounds = args.rounds or (2 if args.quick else 5)
    chunk_s = args.chunk_s or (0.05 if args.quick else 0.25)
    num_blocks = max(batches) * max(clients) + 64
    config = {
        "batches": batches,
        "clients": clients,
        "rounds": rounds,
        "chunk_s": chunk_s,
        "variants": VARIANTS,
        "pool_blocks": num_blocks,
        "pool_layout": POOL_LAYOUT.model_dump(),
        "warmup_rounds": 1,
    }
    report = harness.Report("control-plane", args, device, config)

    pool_flags = [*harness.layout_flags(POOL_LAYOUT), "--num-blocks", str(num_blocks)]
    with harness.servers(
        lambda: harness.start_pool(device, *pool_flags),
        lambda: harness.start_server("bare", ["kvpool.benchmarks.bare_server"]),
    ) as (pool, bare):
        urls = {
            "pool-fast": (pool.url, True, 0.0),
            "pool-fast-spin": (pool.url, True, SPIN_S),
            "pool-http-unix": (pool.url, False, 0.0),
            "pool-http-tcp": (pool.tcp_url, False, 0.0),
            "bare-fast": (bare.url, True, 0.0),
            "bare-http-unix": (bare.url, False, 0.0),
            "bare-http-tcp": (bare.tcp_url, False, 0.0),
        }
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        try:
            for _ in range(max(clients)):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_client, args=(child, urls, max(batches) + 1), daemon=True)
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            for conn in pipes:
                if not conn.poll(120) or conn.recv() != "ready":
                    raise RuntimeError("a client process did not start")
            cells = _measure(pipes, batches, clients, rounds, chunk_s, args.no_progress)
        finally:
            for conn in pipes:
                with contextlib.suppress(OSError):
                    conn.send(None)
            harness.wait_children(procs)

    _summarize(report, cells, batches, clients)
    report.print_block("control-plane", _body(report, batches, clients))
    report.save(lambda: _plot(report, batches, clients))
    return 0


Cell = dict[str, Any]


def _measure(
    pipes: list[Any], batches: list[int], clients: list[int], rounds: int, chunk_s: float, no_progress: bool
) -> dict[tuple[int, int, str], Cell]:
    """Every (batch, clients) cell, the variants interleaved per round in a rotating order; round 0 is warm-up."""
    cells: dict[tuple[int, int, str], Cell] = {}
    plan = [
        (b, n, r, v) for b in batches for n in clients for r in range(rounds + 1) for v in timings.rotated(VARIANTS, r)
    ]
    with harness.progress(len(plan), "control-plane", no_progress) as bar:
        for batch, n, r, variant in plan:
            duration = chunk_s / 4 if r == 0 else chunk_s
            start = time.perf_counter_ns() + 20_000_000
            for conn in pipes[:n]:
                conn.send((variant, batch, start, int(duration * 1e9)))
            replies = [conn.recv() for conn in pipes[:n]]
            bar.update()
            if r == 0:
                continue
            cell = cells.setdefault((batch, n, variant), {"lat": [], "chunks": []})
            for blob, _ in replies:
                lat = array("q")
                lat.frombytes(blob)
                cell["lat"].extend(lat)
            pairs = sum(len(blob) // 8 for blob, _ in replies)
            wall = max(end for _, end in replies) - start
            cell["chunks"].append({"pairs": pairs, "wall_ns": wall, "blocks_per_s": pairs * batch / wall * 1e9})
    return cells


def _summarize(
    report: harness.Report, cells: dict[tuple[int, int, str], Cell], batches: list[int], clients: list[int]
) -> None:
    for (batch, n, variant), cell in cells.items():
        pairs = sum(c["pairs"] for c in cell["chunks"])
        wall = sum(c["wall_ns"] for c in cell["chunks"])
        row = {
            "variant": variant,
            "batch": batch,
            "clients": n,
            **timings.summarize_ns(cell["lat"]),
            "pairs_per_s": pairs / wall * 1e9,
            "blocks_per_s": pairs * batch / wall * 1e9,
        }
        report.results.append(row)
        report.raw[f"{variant}/b{batch}/c{n}"] = {"pair_ns_sample": timings.thin(cell["lat"]), "chunks": cell["chunks"]}

    def get(variant: str, batch: int, n: int, key: str) -> float:
        return next(r[key] for r in report.results if (r["variant"], r["batch"], r["clients"]) == (variant, batch, n))

    b0, c0, big = batches[0], clients[0], max(batches)
    for transport in ("http-unix", "http-tcp", "fast"):
        pool, bare = get(f"pool-{transport}", b0, c0, "p50_us"), get(f"bare-{transport}", b0, c0, "p50_us")
        ratio = pool / bare
        report.targets.append(
            harness.Target(
                f"pair vs bare floor, {transport}, batch {b0}, {c0} client",
                f"<= {TARGET_FLOOR_RATIO}x",
                f"{ratio:.2f}x ({harness.fmt_us(pool)} vs {harness.fmt_us(bare)} p50)",
                ratio <= TARGET_FLOOR_RATIO,
            )
        )
    # the goals are judged on clients as they come (no polling): the spin's figures are beside them
    per_call = {v: get(v, big, c0, "blocks_per_s") for v in POOL_VARIANTS if v != "pool-fast-spin"}
    best = max(per_call, key=lambda v: per_call[v])
    report.targets.append(
        harness.Target(
            f"batched throughput, batch {big}, per call ({c0} client)",
            f">= {TARGET_BLOCKS_PER_S / 1e6:.0f}M blocks/s",
            f"{per_call[best] / 1e6:.2f}M blocks/s over {best}",
            per_call[best] >= TARGET_BLOCKS_PER_S,
            ", ".join(f"{v} {b / 1e6:.2f}M" for v, b in per_call.items())
            + f"; inproc floor {get('inproc', big, c0, 'blocks_per_s') / 1e6:.2f}M",
        )
    )
    agg = {v: max(get(v, big, n, "blocks_per_s") for n in clients) for v in per_call}
    best_agg = max(agg, key=lambda v: agg[v])
    report.targets.append(
        harness.Target(
            f"batched throughput, batch {big}, all clients together",
            f">= {TARGET_BLOCKS_PER_S / 1e6:.0f}M blocks/s",
            f"{agg[best_agg] / 1e6:.2f}M blocks/s over {best_agg}",
            agg[best_agg] >= TARGET_BLOCKS_PER_S,
        )
    )


def _body(report: harness.Report, batches: list[int], clients: list[int]) -> str:
    rows = {(r["variant"], r["batch"], r["clients"]): r for r in report.results}
    parts = []
    for n in clients:
        lat = [
            [b, *(f"{rows[v, b, n]['p50_us']:.0f} / {rows[v, b, n]['p99_us']:.0f}" for v in VARIANTS)] for b in batches
        ]
        parts.append(f"Pair latency p50 / p99 (us), {n} client(s):\n" + harness.table(["batch", *VARIANTS], lat))
    rate = harness.fmt_rate
    tput = [[b, n, *(rate(rows[v, b, n]["blocks_per_s"]) for v in VARIANTS)] for b in batches for n in clients]
    parts.append(
        "Blocks allocated and freed per second, all clients:\n" + harness.table(["batch", "clients", *VARIANTS], tput)
    )
    return "\n\n".join(parts)


def _plot(report: harness.Report, batches: list[int], clients: list[int]) -> Any:
    plt = harness.pyplot()
    rows = {(r["variant"], r["batch"], r["clients"]): r for r in report.results}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    c0, big = clients[0], max(batches)
    for v in VARIANTS:
        style = "--" if v.startswith("bare") else ":" if v == "inproc" else "-"
        axes[0].plot(batches, [rows[v, b, c0]["p50_us"] for b in batches], style, marker="o", label=v)
        axes[1].plot(batches, [rows[v, b, c0]["blocks_per_s"] for b in batches], style, marker="o", label=v)
        axes[2].plot(clients, [rows[v, big, n]["blocks_per_s"] for n in clients], style, marker="o", label=v)
    axes[0].set(
        title=f"alloc+free pair p50, {c0} client", xlabel="blocks per call", ylabel="us", xscale="log", yscale="log"
    )
    axes[1].set(title=f"blocks/s, {c0} client", xlabel="blocks per call", ylabel="blocks/s", xscale="log", yscale="log")
    axes[1].axhline(TARGET_BLOCKS_PER_S, color="grey", lw=0.8, ls="--", label=GOAL_LABEL)
    axes[2].set(
        title=f"blocks/s, batch {big}", xlabel="concurrent clients", ylabel="blocks/s", xscale="log", yscale="log"
    )
    axes[2].axhline(TARGET_BLOCKS_PER_S, color="grey", lw=0.8, ls="--", label=GOAL_LABEL)
    for ax, ticks in zip(axes, (batches, batches, clients), strict=True):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"kvpool control plane ({machine.describe_device(machine.device_info(report.device))})")
    return fig
