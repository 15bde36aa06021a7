"""slab: alloc, free and handoffs with reservation slabs, against the one-way Unix datagram floor of the same run.

Two client processes of one pool started with ``--slabs``, a producer and a consumer, each with a slab. Per
round, interleaved:

  floor        one-way latency of a small Unix datagram from the producer's process to the consumer's, which spins
               on a non-blocking receive (the sender's clock read goes in the datagram; both read CLOCK_MONOTONIC),
               sent to the consumer's path
  floor-connected  the same from a socket connected to that path once, which spares each send the kernel's path
               lookup; the handoff sends this way, so the targets are judged against the lower of the two floors
  handoff      ``handoff(..., to=consumer)`` of slab blocks, from the producer's call to the consumer's ``claim``
               returning the ids it checked (seal, sequence, the producer's region); the consumer spins too. The
               blocks of one alloc, in slot order: the common case, checked and compared a run of slots at a time
  handoff-chunks  the same number of blocks from 4 allocs in a row (as a chunked prefill allocates them): still one
               run of slots
  handoff-scattered  the ids of one alloc in reverse order, which go slot by slot (as ids freed and taken again may)
  handoff-datagram  ``handoff`` from a producer whose slab sends every handoff as a sealed datagram to the consumer's
               box (``SlabConfig(ring=False)``), where the others write it into their ring, which the consumer reads
  pair         ``alloc(1)`` + ``free`` from the producer's slab, in one process
  pool-pair    the same pair through the pool's fast channel (a client without a slab): what slabs replace
  batch        ``alloc(N)`` + ``free`` of N blocks from the producer's slab, whose slots the handoffs have
               scattered: blocks allocated (and freed) per second; the target is judged on this one
  batch-run    the same from a slab of a third client that only does batches: each alloc's slots come back as a run,
               which is freed and taken again through slices

The pool settles handed blocks afterwards: the consumer frees what it claimed in bulk, outside the timed part.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import time
from array import array
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

POOL_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")
TARGET_FLOOR_RATIO = 3.0
TARGET_BLOCKS_PER_S = 10e6
CONSUMER = "bench-slab-consumer"
FLOORS = ("floor", "floor-connected")
HANDOFFS = ("handoff", "handoff-chunks", "handoff-scattered", "handoff-datagram")
CHUNKS = 4
VARIANTS = (*FLOORS, *HANDOFFS, "pair", "pool-pair")
BATCHES = ("batch", "batch-run")
#: blocks a consumer collects before it frees them (its free settles and goes through the pool)
FREE_EVERY = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=None, help="samples per variant per round [500]")
    parser.add_argument("--handoff-blocks", type=int, default=16, help="blocks per handoff [16]")
    parser.add_argument("--batch", type=int, default=1024, help="blocks per batched alloc [1024]")


def _slab(batch: int, ring: bool = True) -> Any:
    from kvpool.slab import SlabConfig

    return SlabConfig(blocks=batch + 512, low=batch + 64, high=4 * batch + 1024, ring=ring)


def _spin_recv(sock: socket.socket, buf: bytearray) -> int:
    while True:
        try:
            return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue


def _consumer(conn: Any, url: str, floor_path: str, ready_path: str, batch: int) -> None:
    from kvpool.slab import SlabClient

    pool = SlabClient(url, name=CONSUMER, slab=_slab(batch), heartbeat=False, spin_s=2.0)
    box = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    box.bind(floor_path)
    back = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    buf = bytearray(64)
    clock = time.perf_counter_ns
    held = array("q")
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            kind, count = msg
            lat = array("q")
            for _ in range(count):
                back.sendto(b"go", ready_path)
                if kind in FLOORS:
                    _spin_recv(box, buf)
                    t1 = clock()
                    lat.append(t1 - int.from_bytes(buf[:8], "little"))
                else:
                    got = pool.claim(None, timeout_s=30)
                    t1 = clock()
                    lat.append(t1 - int(got.request_id.rsplit("-", 1)[1]))
                    held.extend(got.ids)
                    if len(held) >= FREE_EVERY:  # housekeeping in bulk, so that the pool is mostly idle meanwhile
                        pool.free(held)
                        del held[:]
            conn.send(lat.tobytes())
    finally:
        pool.close()
        box.close()


def _producer(conn: Any, url: str, floor_path: str, ready_path: str, batch: int, blocks: int) -> None:
    from kvpool.client import PoolClient
    from kvpool.slab import SlabClient

    pool = SlabClient(url, name="bench-slab-producer", slab=_slab(batch), heartbeat=False)
    plain = PoolClient(url, name="bench-slab-plain", heartbeat=False)
    batcher = SlabClient(url, name="bench-slab-batcher", slab=_slab(batch), heartbeat=False)
    sealed = SlabClient(url, name="bench-slab-datagrams", slab=_slab(batch, ring=False), heartbeat=False)
    ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ready.bind(ready_path)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    connected = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    connected.connect(floor_path)
    clock = time.perf_counter_ns
    pad = bytes(24)
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            kind, count, n = msg
            lat = array("q")
            if kind in (*FLOORS, *HANDOFFS):
                producer = sealed if kind == "handoff-datagram" else pool
                for i in range(count):
                    ids = producer.alloc(blocks) if kind in HANDOFFS and kind != "handoff-chunks" else None
                    if kind == "handoff-chunks":
                        ids = [i for _ in range(CHUNKS) for i in pool.alloc(blocks // CHUNKS)]
                    elif kind == "handoff-scattered":
                        ids = ids[::-1]  # type: ignore[index]  # not in slot order: checked slot by slot
                    ready.recv(16)
                    t0 = clock()
                    if kind == "floor":
                        out.sendto(t0.to_bytes(8, "little") + pad, floor_path)
                    elif kind == "floor-connected":
                        connected.send(t0.to_bytes(8, "little") + pad)
                    else:
                        producer.handoff(f"r{i}-{t0}", ids, blocks * POOL_LAYOUT.block_size, to=CONSUMER)
            else:
                client = {"pool-pair": plain, "batch-run": batcher}.get(kind, pool)
                alloc, free = client.alloc, client.free
                free(alloc(n))
                for _ in range(count):
                    t0 = clock()
                    free(alloc(n))
                    lat.append(clock() - t0)
            conn.send(lat.tobytes())
    finally:
        for client in (pool, plain, batcher, sealed):
            client.close()
        ready.close()
        connected.close()


def run(args: argparse.Namespace) -> int:
    device = machine.resolve_device(args)
    rounds = args.rounds or (2 if args.quick else 5)
    count = args.count or (50 if args.quick else 500)
    batch, blocks = args.batch, args.handoff_blocks
    num_blocks = 10 * batch + 4096
    config = {"rounds": rounds, "count": count, "batch": batch, "handoff_blocks": blocks, "pool_blocks": num_blocks,
              "pool_layout": POOL_LAYOUT.model_dump(), "warmup_rounds": 1}  # fmt: skip
    report = harness.Report("slab", args, device, config)
    flags = [*harness.layout_flags(POOL_LAYOUT), "--num-blocks", str(num_blocks), "--slabs",
             "--slab-max-blocks", str(8 * batch)]  # fmt: skip
    samples: dict[str, list[int]] = {v: [] for v in (*VARIANTS, *BATCHES)}
    with harness.servers(lambda: harness.start_pool(device, *flags)) as (pool,):
        assert pool.workdir is not None  # removed as the pool stops, with these sockets in it
        floor_path, ready_path = str(pool.workdir / "floor.sock"), str(pool.workdir / "ready.sock")
        ctx = mp.get_context("spawn")
        (pa, pb), (ca, cb) = ctx.Pipe(), ctx.Pipe()
        cons = ctx.Process(target=_consumer, args=(cb, pool.url, floor_path, ready_path, batch), daemon=True)
        prod = ctx.Process(target=_producer, args=(pb, pool.url, floor_path, ready_path, batch, blocks), daemon=True)
        cons.start()
        if not ca.poll(120) or ca.recv() != "ready":
            raise RuntimeError("the consumer process did not start")
        prod.start()
        if not pa.poll(120) or pa.recv() != "ready":
            raise RuntimeError("the producer process did not start")
        try:
            plan = [(r, v) for r in range(rounds + 1) for v in timings.rotated((*VARIANTS, *BATCHES), r)]
            with harness.progress(len(plan), "slab", args.no_progress) as bar:
                for r, variant in plan:
                    n = count if r else max(10, count // 10)
                    if variant in (*FLOORS, *HANDOFFS):
                        ca.send((variant, n))
                        pa.send((variant, n, 0))
                        pa.recv()
                        blob = ca.recv()
                    else:
                        pa.send((variant, n, batch if variant in BATCHES else 1))
                        blob = pa.recv()
                    bar.update()
                    if r:
                        lat = array("q")
                        lat.frombytes(blob)
                        samples[variant].extend(lat)
        finally:
            for conn in (pa, ca):
                with contextlib.suppress(OSError):
                    conn.send(None)
            harness.wait_children([prod, cons])
    _summarize(report, samples, batch, blocks)
    report.print_block("slab", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _summarize(report: harness.Report, samples: dict[str, list[int]], batch: int, blocks: int) -> None:
    sizes = {**dict.fromkeys(FLOORS, 0), **dict.fromkeys(HANDOFFS, blocks), "pair": 1, "pool-pair": 1}
    sizes |= dict.fromkeys(BATCHES, batch)
    for variant, lat in samples.items():
        row = {"variant": variant, "blocks": sizes[variant], **timings.summarize_ns(lat)}
        if variant in BATCHES:
            row["blocks_per_s"] = batch / (row["p50_us"] / 1e6)
        report.results.append(row)
        report.raw[variant] = timings.thin(lat)
    rows = {r["variant"]: r for r in report.results}
    floor = min(rows[f]["p50_us"] for f in FLOORS)
    for variant, what in (("pair", "alloc+free pair (slab, 1 block)"), ("handoff", f"handoff ({blocks} blocks)")):
        ratio = rows[variant]["p50_us"] / floor
        report.targets.append(harness.Target(
            f"{what} vs one-way datagram floor (the lower of the two)", f"<= {TARGET_FLOOR_RATIO:.0f}x",
            f"{ratio:.2f}x ({harness.fmt_us(rows[variant]['p50_us'])} vs {harness.fmt_us(floor)} p50)",
            ratio <= TARGET_FLOOR_RATIO,
        ))  # fmt: skip
    rate = rows["batch"]["blocks_per_s"]
    report.targets.append(harness.Target(
        f"batched alloc+free from the slab, {batch} blocks a call", f">= {TARGET_BLOCKS_PER_S / 1e6:.0f}M blocks/s",
        f"{rate / 1e6:.1f}M blocks/s (p50 pair {harness.fmt_us(rows['batch']['p50_us'])})",
        rate >= TARGET_BLOCKS_PER_S,
    ))  # fmt: skip


def _body(report: harness.Report) -> str:
    head = ["variant", "blocks", "p50 us", "p90 us", "p99 us", "n"]
    rows = [[r["variant"], r["blocks"], f"{r['p50_us']:.1f}", f"{r['p90_us']:.1f}", f"{r['p99_us']:.1f}", r["n"]]
            for r in report.results]  # fmt: skip
    return "Latency (one-way for floor and handoff; the whole call for pairs):\n" + harness.table(head, rows)


def _plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = report.results
    ax.bar([r["variant"] for r in rows], [r["p50_us"] for r in rows], label="p50")
    ax.scatter([r["variant"] for r in rows], [r["p99_us"] for r in rows], color="k", marker="_", s=200, label="p99")
    floor = min(r["p50_us"] for r in rows if r["variant"] in FLOORS)
    ax.axhline(TARGET_FLOOR_RATIO * floor, color="grey", lw=0.8, ls="--", label=f"{TARGET_FLOOR_RATIO:.0f}x floor")
    ax.set(ylabel="us", yscale="log", title="slab alloc/free and handoff against the datagram floor")
    ax.legend(fontsize=8)
    fig.suptitle(f"kvpool slabs ({machine.describe_device(machine.device_info(report.device))})")
    return fig
