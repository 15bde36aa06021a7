"""copy: moving a request's KV between two GPUs' arenas by block ids, against a plain peer copy of the bytes.

A pool serves one arena per device (``--devices 0,1``); this process maps both, as a decode worker on the second
GPU would. Per size, interleaved round by round:

* ``blocks``: :func:`kvpool.transfer.copy_blocks` of N scattered blocks (every layer's K and V) from arena 0
  into N scattered blocks of arena 1: one gather, one peer copy, one scatter;
* ``move``: :meth:`PoolClient.move`, the same copy with the pool calls around it (alloc on the target, free of
  the source once the copy has read it);
* ``peer-copy``: ``dst.copy_(src)`` of the same number of bytes between two contiguous buffers on the two
  devices: what the links give with no block structure at all.

Bandwidth counts the KV bytes moved once (not read plus write). Without two GPUs it runs on two CPU arenas.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

MIB = 1 << 20
GIB = 1 << 30
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")  # 2 MiB blocks
VARIANTS = ("blocks", "move", "peer-copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=harness.size_list, default=None, help="KV per copy [64MiB,256MiB,1GiB,4GiB]")


def _sync(devices: list[Any]) -> None:
    import torch

    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.client import PoolClient
    from kvpool.transfer import copy_blocks

    device = machine.resolve_device(args)
    two_gpus = device.is_cuda and torch.cuda.device_count() >= 2
    backend = machine.Device("cuda" if two_gpus else "cpu")
    sizes = args.sizes or ([4 * MIB, 16 * MIB] if args.quick else [64 * MIB, 256 * MIB, GIB, 4 * GIB])
    if not two_gpus:
        sizes = [s for s in sizes if s <= 256 * MIB]
    per_block = LAYOUT.block_nbytes
    counts = [max(1, s // per_block) for s in sizes]
    num_blocks = 3 * max(counts) + 16
    rounds = args.rounds or (2 if args.quick else 10)
    report = harness.Report("copy", args, backend, {})
    report.config.update(sizes=sizes, blocks=counts, rounds=rounds, warmup_rounds=1, layout=LAYOUT.model_dump(),
                         arenas="two GPUs" if two_gpus else "two CPU arenas (no second GPU)")  # fmt: skip
    if not two_gpus:
        report.notes.append("ran on two CPU arenas: the figures are memory copies, not GPU links")
    samples: dict[tuple[int, str], list[int]] = {(n, v): [] for n in counts for v in VARIANTS}
    rng = random.Random(args.seed)
    flags = ["--devices", "0,1", "--num-blocks", str(num_blocks), *harness.layout_flags(LAYOUT)]
    with harness.start_pool(backend, *flags) as pool, PoolClient(pool.url, name="copy-bench") as client:
        a0, a1 = client.arena(device=0), client.arena(device=1)
        devs = [a0.device, a1.device]
        spare = max(counts) + 8  # room for the move variant's fresh blocks on both arenas
        src_all = client.alloc(num_blocks - spare, device=0)
        dst_all = client.alloc(num_blocks - spare, device=1)
        src_buf = torch.empty(max(counts) * per_block, dtype=torch.uint8, device=a0.device)
        dst_buf = torch.empty_like(src_buf, device=a1.device)
        with harness.progress(len(counts) * (rounds + 1) * len(VARIANTS), "copy", args.no_progress) as bar:
            for r in range(rounds + 1):
                for n in timings.rotated(counts, r):
                    for variant in timings.rotated(list(VARIANTS), r):
                        src, dst = rng.sample(src_all, n), rng.sample(dst_all, n)
                        _sync(devs)
                        t0 = time.perf_counter_ns()
                        if variant == "blocks":
                            copy_blocks(a0, src, a1, dst)
                        elif variant == "move":
                            mine = client.alloc(n, device=0)
                            t0 = time.perf_counter_ns()  # the source blocks exist already in a real handoff
                            client.free(client.move(mine, device=1))
                        else:
                            dst_buf[: n * per_block].copy_(src_buf[: n * per_block], non_blocking=True)
                        _sync(devs)
                        if r:
                            samples[(n, variant)].append(time.perf_counter_ns() - t0)
                        bar.update()
        if a0.device.type == "cuda":
            _check(client, a0, a1, rng)
    for n, size in zip(counts, sizes, strict=True):
        for v in VARIANTS:
            stats = timings.summarize_ns(samples[(n, v)])
            gbps = n * per_block / (stats["p50_us"] * 1e-6) / 1e9
            report.results.append({"bytes": n * per_block, "blocks": n, "variant": v, "gb_per_s_p50": gbps, **stats})
        del size
    _targets(report, counts)
    report.print_block("copy", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _check(client: Any, a0: Any, a1: Any, rng: random.Random) -> None:
    """One copy's bytes, checked: a figure of a wrong copy would be worth nothing."""
    import torch

    from kvpool.transfer import copy_blocks

    src, dst = client.alloc(4, device=0), client.alloc(4, device=1)
    view0, dim = a0.blocks_view()
    idx0 = torch.tensor(a0.local_ids(src), device=a0.device)
    payload = torch.randn(view0.index_select(dim, idx0).shape, device=a0.device).to(view0.dtype)
    view0.index_copy_(dim, idx0, payload)
    copy_blocks(a0, src, a1, dst)
    torch.cuda.synchronize(a1.device)
    got = a1.blocks_view()[0].index_select(dim, torch.tensor(a1.local_ids(dst), device=a1.device))
    if not torch.equal(got.cpu(), payload.cpu()):
        raise SystemExit("copy: the copied blocks differ from the source")
    client.free(src + dst)
    del rng


def _row(report: harness.Report, n: int, v: str) -> dict[str, Any]:
    return next(r for r in report.results if r["blocks"] == n and r["variant"] == v)


def _targets(report: harness.Report, counts: list[int]) -> None:
    n = counts[-1]
    blocks, peer = _row(report, n, "blocks"), _row(report, n, "peer-copy")
    report.targets.append(
        harness.Target(
            f"block copy vs plain peer copy ({harness.fmt_bytes(blocks['bytes'])})",
            "compare",
            f"{blocks['gb_per_s_p50']:.0f} vs {peer['gb_per_s_p50']:.0f} GB/s "
            f"({blocks['gb_per_s_p50'] / peer['gb_per_s_p50']:.2f}x)",
            None,
        )
    )


def _body(report: harness.Report) -> str:
    rows = []
    for n in report.config["blocks"]:
        cells = [harness.fmt_bytes(n * LAYOUT.block_nbytes), str(n)]
        for v in VARIANTS:
            r = _row(report, n, v)
            cells.append(f"{harness.fmt_us(r['p50_us'])} ({r['gb_per_s_p50']:.0f} GB/s)")
        rows.append(cells)
    head = ["KV", "blocks", *(f"{v} p50" for v in VARIANTS)]
    return f"Copy between two arenas ({report.config['arenas']}), p50 of {report.config['rounds']}:\n" + harness.table(
        head, rows
    )


def _plot(report: harness.Report) -> Any:
    return harness.bandwidth_plot(report, VARIANTS, "copy between arenas (p50)", "copy")
