"""handoff: prefill -> decode KV handoff through the pool, against what users do instead, in the same run.

Two real processes (a producer standing for the prefill, a consumer for the decode) and a real pool. For each KV
size the variants run interleaved, round by round:

  pool-direct the consumer (a client with an inbox) waits in ``claim(request_id)``, watching its inbox; the producer
              calls ``handoff(..., to=consumer)``, which writes the handoff to the pool; the pool parks it and sends
              the ids, sealed, to the inbox; done when the claim returned: the consumer holds the block ids, and the
              arena's per-layer views were mapped once, at start (``arena.k(layer)[block]`` is a view of the
              producer's KV). The pool's answer to the claim (ownership moved in its books) comes after, off this
              path.
  pool-fast   the consumer has ``claim(request_id, timeout_s)`` pending in the pool over the fast channel; the
              producer calls ``handoff``; done when the pool's answer to the waiting claim returned
  pool-http   the same through HTTP (PoolClient(fast=False)), to show what the fast channel saves

For every pool variant the parts are reported too: when the producer's call returned, when a device block table
built from the ids was enqueued on the consumer's stream (what a paged-attention step then adds, paid again each
step by any engine) and landed there, and when the pool confirmed a direct claim.
  mp-queue    the KV as 64 per-layer tensors (32 layers x K, V), fresh per request, put on a torch.multiprocessing
              Queue (CUDA IPC per tensor on GPU, shared memory on CPU); done when the consumer got them all and
              synchronized
  copy        ``copy_`` of the same bytes into 64 fresh tensors on the same device, synchronized (device to device
              on GPU; a memory copy on CPU): the cost of moving the KV once
  pinned      (GPU only) device -> pinned host -> device through preallocated pinned buffers

The pool and mp-queue timings cross processes on one clock: ``time.perf_counter_ns`` is CLOCK_MONOTONIC, the same
in every process on Linux. A KV of S bytes takes ceil(S / block bytes) arena blocks (default layout: 32 layers,
8 KV heads, head dim 128, fp16, 16 tokens a block = 2 MiB blocks); every tensor variant moves exactly S bytes.
The producer holds its block ids as an int64 array (fenced ids, as the pool gave them), and the consumer builds
its device table from the ids as they arrived (generations masked off in one tensor operation): no id is
converted one by one on the way. (What converting
from and to Python lists would add is measured apart and printed in the notes.) After each trial the consumer
waits for the table and checks a marker the producer wrote, outside the timed span.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import uuid
from array import array
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.benchmarks.handoff_actors import Peer
from kvpool.benchmarks.handoff_report import GIB, MIB, POOL, body, plot, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=harness.size_list,
        default=None,
        help="KV bytes per request [GPU 1MiB,16MiB,256MiB,1GiB,4GiB,8GiB; CPU 1MiB,16MiB,256MiB]",
    )
    parser.add_argument(
        "--max-bytes",
        type=harness.parse_size,
        default=None,
        help="drop sizes above this [GPU 8GiB, CPU 256MiB; at most 1GiB makes sense on CPU]",
    )
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--claim-lead-ms",
        type=float,
        default=5.0,
        help="how long the consumer's claim is pending before the producer hands off [5]",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants to run [all: pool-direct,pool-fast,pool-http,mp-queue,copy and, on GPU, pinned]",
    )
    parser.add_argument(
        "--spin-ms",
        type=float,
        default=1000.0,
        help="how long pool-direct's consumer watches its inbox before it waits in the pool instead [1000]",
    )


# -- the run -----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as tmp

    from kvpool.layout import KVLayout

    device = machine.resolve_device(args)
    layout = KVLayout(
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype="float16",
    )
    max_bytes = args.max_bytes or (8 * GIB if device.is_cuda else 256 * MIB)
    if args.sizes:
        sizes = args.sizes
    elif args.quick:
        sizes = [1 * MIB, 64 * MIB, 1 * GIB] if device.is_cuda else [1 * MIB, 8 * MIB]
    else:
        sizes = [s * MIB for s in (1, 16, 256, 1024, 4096, 8192)]
    sizes = sorted(s for s in sizes if s <= max_bytes) or [min(sizes)]
    rounds = args.rounds or (3 if args.quick else 10)
    variants = [*POOL, "mp-queue", "copy", *(["pinned"] if device.is_cuda else [])]
    if args.variants:
        asked = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(asked) - set(variants))
        if unknown or POOL[0] not in asked:
            raise SystemExit(f"--variants: {POOL[0]} and any of {variants}; unknown here: {unknown}")
        variants = [v for v in variants if v in asked]
    per_token = layout.block_nbytes // layout.block_size
    num_blocks = math.ceil(max(sizes) / layout.block_nbytes) + 1
    config = {
        "sizes": sizes,
        "rounds": rounds,
        "warmup_rounds": 1,
        "variants": variants,
        "layout": layout.model_dump(),
        "block_nbytes": layout.block_nbytes,
        "arena_blocks": num_blocks,
        "tensors": 2 * layout.num_layers,
        "claim_lead_ms": args.claim_lead_ms,
        "spin_ms": args.spin_ms,
        "producer_ids": "array('q')",
    }
    report = harness.Report("handoff", args, device, config)
    samples: dict[tuple[int, str], list[int]] = {}
    breakdown: dict[tuple[int, str, str], list[int]] = {}
    failures: list[str] = []

    flags = [*harness.layout_flags(layout), "--num-blocks", str(num_blocks)]
    with harness.start_pool(device, *flags) as pool:
        ctx = tmp.get_context("spawn")
        queue, ready = ctx.Queue(), ctx.Event()
        lead, spin = args.claim_lead_ms / 1e3, args.spin_ms / 1e3
        peers = [
            Peer(ctx, role, pool.url, device.torch_device, queue, ready, lead, spin)
            for role in ("producer", "consumer")
        ]
        producer, consumer = peers
        try:
            for peer in peers:
                peer.started()
            total = len(sizes) * (rounds + 1) * len(variants)
            with harness.progress(total, "handoff", args.no_progress) as bar:
                for size in sizes:
                    producer.call("setup", size)
                    blocks, tokens = math.ceil(size / layout.block_nbytes), max(1, size // per_token)
                    for r in range(rounds + 1):
                        for variant in timings.rotated(variants, r):
                            marker = float(r % 1000 + 1)
                            ns, ok, parts = _trial(variant, producer, consumer, size, blocks, tokens, marker)
                            bar.update()
                            if not ok:
                                failures.append(f"{variant} at {harness.fmt_bytes(size)}: the consumer read wrong KV")
                            if r > 0:
                                samples.setdefault((size, variant), []).append(ns)
                                for part, value in parts.items():
                                    breakdown.setdefault((size, variant, part), []).append(value)
                    producer.call("setup", 0)
        finally:
            for peer in peers:
                peer.stop()

    report.notes.extend(failures)
    report.notes.append(_conversions(sizes, layout.block_nbytes))
    summarize(report, samples, breakdown, sizes, variants, layout.block_nbytes)
    report.print_block("handoff", body(report, sizes, variants))
    report.save(lambda: plot(report, sizes, variants))
    return 1 if failures else 0


def _trial(
    variant: str, producer: Peer, consumer: Peer, size: int, blocks: int, tokens: int, marker: float
) -> tuple[int, bool, dict[str, int]]:
    """One timed handoff of ``size`` bytes by ``variant``: nanoseconds, whether the consumer read the right KV, and
    for the pool the parts: the producer's handoff call, the claim's return after it, the block table's build."""
    if variant.startswith("pool-"):
        request_id = uuid.uuid4().hex
        consumer.send("claim", variant, request_id, marker)
        t0, returned = producer.call("handoff", variant, request_id, blocks, tokens, marker)
        at, ok = consumer.reply()
        parts = {"handoff_call": returned - t0, "table": at["enqueued"] - at["claimed"], "landed": at["landed"] - t0}
        if "confirmed" in at:
            parts["confirmed"] = at["confirmed"] - t0
        return at["claimed"] - t0, ok, parts
    if variant == "mp-queue":
        consumer.send("get", marker)
        t0 = producer.call("put", size, marker)
        t1, ok = consumer.reply()
        return t1 - t0, ok, {}
    return producer.call("copy" if variant == "copy" else "pinned_copy"), True, {}


def _conversions(sizes: list[int], block_nbytes: int) -> str:
    """What Python lists would add: packing a producer's list of ids, and a consumer's list from packed ids."""
    parts = []
    for size in sizes:
        n = math.ceil(size / block_nbytes)
        ids = list(range(n))
        packed = array("q", ids)
        pack = statistics.median(_time_ns(lambda ids=ids: array("q", ids)) for _ in range(51))
        unpack = statistics.median(_time_ns(packed.tolist) for _ in range(51))
        parts.append(f"{n} ids: pack {pack / 1e3:.1f} us, to a list {unpack / 1e3:.1f} us")
    return "with Python lists instead of packed int64 ids, each side would add (this CPU, median): " + "; ".join(parts)


def _time_ns(fn: Any) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0
