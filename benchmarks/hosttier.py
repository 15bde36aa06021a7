"""host-tier: the pool's copies between its arena and the host tier, against a plain pinned copy of the same bytes.

This process builds what ``kvpool serve --host-blocks`` builds (the arena, the host tier's page-locked file in
``--shm-dir``, the pool's copy engine) and times its copies directly, without HTTP around them. Per size,
interleaved round by round:

* ``restore``: N host blocks with neighbouring ids (what a chain offloaded in one batch gets) into N scattered
  arena blocks: the copy a lookup that hits in the host tier waits for;
* ``restore-scattered``: the same from N host blocks scattered at random (a fragmented host tier: one copy each);
* ``offload``: N scattered arena blocks into N neighbouring host blocks (an eviction batch);
* ``plain-h2d`` and ``plain-d2h``: ``dst.copy_(src)`` of the same bytes between a pinned host buffer
  (``pin_memory``) and one contiguous device buffer: what the link gives with no block structure at all.

Bandwidth counts the KV bytes moved once. Without a GPU it runs on two CPU arenas (memory copies, not PCIe).
"""

from __future__ import annotations

import argparse
import random
import secrets
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

MIB = 1 << 20
GIB = 1 << 30
LAYOUTS = {
    "8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),  # 2 MiB blocks
    "1b": KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16"),  # 512 KiB blocks
}
VARIANTS = ("restore", "restore-scattered", "offload", "plain-h2d", "plain-d2h")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=harness.size_list, default=None, help="KV per copy [64MiB,256MiB,1GiB]")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="8b", help="block shape [8b: 2 MiB blocks]")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="where the host tier's file goes")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.server.arenas import create_owned_arena, describe
    from kvpool.server.tiers.tiermemory import HostTierMemory

    device = machine.resolve_device(args)
    layout = LAYOUTS[args.layout]
    sizes = args.sizes or ([4 * MIB, 16 * MIB] if args.quick else [64 * MIB, 256 * MIB, GIB])
    per_block = layout.block_nbytes
    counts = [max(1, s // per_block) for s in sizes]
    num_blocks = max(16, 2 * max(counts))
    rounds = args.rounds or (2 if args.quick else 10)
    report = harness.Report("host-tier", args, device, {})
    report.config.update(sizes=sizes, blocks=counts, rounds=rounds, warmup_rounds=1, layout=layout.model_dump(),
                         arena_blocks=num_blocks, host_blocks=num_blocks)  # fmt: skip
    if not device.is_cuda:
        report.notes.append("ran without a GPU: the figures are memory copies, not PCIe")
    epoch = secrets.token_hex(8)
    backend = "cuda" if device.is_cuda else "cpu"
    arena = create_owned_arena(backend, num_blocks * per_block, device=args.gpu, shm_dir=args.shm_dir, epoch=epoch)
    memory = None
    try:
        descriptor = describe(epoch, [args.gpu], [arena], [num_blocks], layout, "", None)
        memory = HostTierMemory(num_blocks, layout, args.shm_dir, epoch, descriptor, [arena])
        copier = memory.tier.copier
        dev = copier.arenas[0][0].device
        _check(copier, num_blocks, dev)
        pinned = torch.empty(max(counts) * per_block, dtype=torch.uint8)
        pinned = pinned.pin_memory() if device.is_cuda else pinned
        flat = torch.empty(max(counts) * per_block, dtype=torch.uint8, device=dev)
        samples: dict[tuple[int, str], list[int]] = {(n, v): [] for n in counts for v in VARIANTS}
        rng = random.Random(args.seed)
        with harness.progress(len(counts) * (rounds + 1) * len(VARIANTS), "host-tier", args.no_progress) as bar:
            for r in range(rounds + 1):
                for n in timings.rotated(counts, r):
                    for variant in timings.rotated(list(VARIANTS), r):
                        took = _one(variant, n, copier, num_blocks, per_block, pinned, flat, rng)
                        if r:
                            samples[(n, variant)].append(took)
                        bar.update()
    finally:
        if memory is not None:
            memory.close()
        arena.close()
    for n in counts:
        for v in VARIANTS:
            stats = timings.summarize_ns(samples[(n, v)])
            gbps = n * per_block / (stats["p50_us"] * 1e-6) / 1e9
            report.results.append({"bytes": n * per_block, "blocks": n, "variant": v, "gb_per_s_p50": gbps, **stats})
    _targets(report, counts)
    report.print_block("host-tier", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _one(variant: str, n: int, copier: Any, num_blocks: int, per_block: int, pinned: Any, flat: Any,
         rng: random.Random) -> int:  # fmt: skip
    """One timed copy (ns), from launch to the device being done with it."""
    import torch

    device_ids = rng.sample(range(num_blocks), n)
    first = rng.randrange(num_blocks - n + 1)
    host_ids = rng.sample(range(num_blocks), n) if variant == "restore-scattered" else list(range(first, first + n))
    cuda = flat.is_cuda
    if cuda:
        torch.cuda.synchronize(flat.device)
    t0 = time.perf_counter_ns()
    if variant.startswith("restore"):
        copier.restore(0, host_ids, device_ids)
    elif variant == "offload":
        copier.offload(0, device_ids, host_ids)
    elif variant == "plain-h2d":
        flat[: n * per_block].copy_(pinned[: n * per_block], non_blocking=True)
    else:
        pinned[: n * per_block].copy_(flat[: n * per_block], non_blocking=True)
    if cuda:
        torch.cuda.synchronize(flat.device)
    return time.perf_counter_ns() - t0


def _check(copier: Any, num_blocks: int, dev: Any) -> None:
    """A round trip's bytes, checked: a figure of a wrong copy would be worth nothing."""
    import torch

    view, dim = copier.arenas[0]
    src, host, dst = [0, 5, 3], [7, 8, 9], [num_blocks - 1, 2, 11]
    idx = torch.tensor(src, device=dev)
    payload = torch.randn(view.index_select(dim, idx).shape, device=dev).to(view.dtype)
    view.index_copy_(dim, idx, payload)
    copier.offload(0, src, host)
    copier.restore(0, host, dst)
    got = view.index_select(dim, torch.tensor(dst, device=dev))
    if not torch.equal(got.cpu(), payload.cpu()):
        raise SystemExit("host-tier: the restored blocks differ from the offloaded ones")


def _row(report: harness.Report, n: int, v: str) -> dict[str, Any]:
    return next(r for r in report.results if r["blocks"] == n and r["variant"] == v)


def _targets(report: harness.Report, counts: list[int]) -> None:
    n = counts[-1]
    for ours, plain in (("restore", "plain-h2d"), ("offload", "plain-d2h")):
        a, b = _row(report, n, ours), _row(report, n, plain)
        ratio = a["gb_per_s_p50"] / b["gb_per_s_p50"]
        report.targets.append(
            harness.Target(
                f"{ours} vs {plain} ({harness.fmt_bytes(a['bytes'])})",
                ">= 0.8x" if ours == "restore" else "compare",
                f"{a['gb_per_s_p50']:.1f} vs {b['gb_per_s_p50']:.1f} GB/s ({ratio:.2f}x)",
                ratio >= 0.8 if ours == "restore" and report.device.is_cuda else None,
            )
        )


def _body(report: harness.Report) -> str:
    rows = []
    for n in report.config["blocks"]:
        cells = [harness.fmt_bytes(_row(report, n, VARIANTS[0])["bytes"]), str(n)]
        for v in VARIANTS:
            r = _row(report, n, v)
            cells.append(f"{harness.fmt_us(r['p50_us'])} ({r['gb_per_s_p50']:.1f} GB/s)")
        rows.append(cells)
    head = ["KV", "blocks", *(f"{v} p50" for v in VARIANTS)]
    title = f"Copies between the arena and the host tier, p50 of {report.config['rounds']}:"
    return f"{title}\n{harness.table(head, rows)}"


def _plot(report: harness.Report) -> Any:
    return harness.bandwidth_plot(report, VARIANTS, "arena <-> host tier (p50)", "host tier")
