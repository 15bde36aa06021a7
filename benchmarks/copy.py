"""copy: moving a request's KV between two GPUs' arenas by block ids, against a plain peer copy of the bytes.

A pool serves one arena per device (``--devices 0,1``); this process maps both, as a decode worker on the second
GPU would. Per layout (``--layout``: ``8b``, 2 MiB blocks of 32 layers; ``resident``, the kv_packed arena that
``kvpool bench vllm`` gives its resident engines, 32 KiB a layer and block, 64 blocks a request) and size,
interleaved round by round:

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
LAYOUTS = {
    "8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"),  # 2 MiB blocks
    # kvpool bench vllm's resident engines: 512 KiB blocks, 32 MiB a request of 64 blocks (1024 byte ranges)
    "resident": KVLayout(
        num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16", order="kv_packed"
    ),
}
#: resident: one request's blocks (64), eight, and a burst's shared prefixes as ``kvpool bench vllm --engines peers``
#: copies them (32 prompts x 48 blocks, one copy)
SIZES = {"8b": [64 * MIB, 256 * MIB, GIB, 4 * GIB], "resident": [32 * MIB, 256 * MIB, 768 * MIB]}
VARIANTS = ("blocks", "move", "peer-copy")
#: the goal of issue 37: scattered blocks between two GPUs at this share of a plain peer copy's bandwidth
GOAL = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = "; ".join(f"{n}: {','.join(harness.fmt_bytes(s).replace(' ', '') for s in v)}" for n, v in SIZES.items())
    parser.add_argument("--sizes", type=harness.size_list, default=None, help=f"KV per copy, every layout [{sizes}]")
    parser.add_argument("--layout", type=_layouts, default=list(LAYOUTS), metavar="NAME[,NAME]",
                        help=f"block shapes, one pool each, of {', '.join(LAYOUTS)} [both]")  # fmt: skip
    own = ", ".join(f"{n} {lay.order}" for n, lay in LAYOUTS.items())
    parser.add_argument("--order", choices=("layer_major", "kv_packed", "block_major"), default=None,
                        help=f"the arena order of every layout [each its own: {own}]")  # fmt: skip


def _layouts(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"layouts are {', '.join(LAYOUTS)}, got {text!r}")
    return names


def _sync(devices: list[Any]) -> None:
    import torch

    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def run(args: argparse.Namespace) -> int:
    import torch

    device = machine.resolve_device(args)
    two_gpus = device.is_cuda and torch.cuda.device_count() >= 2
    backend = machine.Device("cuda" if two_gpus else "cpu")
    rounds = args.rounds or (2 if args.quick else 10)
    report = harness.Report("copy", args, backend, {})
    layouts = {name: LAYOUTS[name].model_copy(update={"order": args.order or LAYOUTS[name].order})
               for name in args.layout}  # fmt: skip
    arenas = "two GPUs" if two_gpus else "two CPU arenas (no second GPU)"
    report.config.update(rounds=rounds, warmup_rounds=1, layouts={n: lay.model_dump() for n, lay in layouts.items()},
                         sizes={}, blocks={}, arenas=arenas)  # fmt: skip
    if not two_gpus:
        report.notes.append("ran on two CPU arenas: the figures are memory copies, not GPU links")
    rng = random.Random(args.seed)
    for name, layout in layouts.items():
        sizes = args.sizes or ([4 * MIB, 16 * MIB] if args.quick else SIZES[name])
        if not two_gpus:
            sizes = [s for s in sizes if s <= 256 * MIB]
        counts = [max(1, s // layout.block_nbytes) for s in sizes]
        report.config["sizes"][name], report.config["blocks"][name] = sizes, counts
        samples = _measure(args, name, layout, counts, rounds, backend, rng)
        for n in counts:
            for v in VARIANTS:
                stats = timings.summarize_ns(samples[(n, v)])
                gbps = n * layout.block_nbytes / (stats["p50_us"] * 1e-6) / 1e9
                report.results.append({"layout": name, "bytes": n * layout.block_nbytes, "blocks": n, "variant": v,
                                       "gb_per_s_p50": gbps, **stats})  # fmt: skip
    _targets(report, two_gpus)
    report.print_block("copy", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _measure(args: argparse.Namespace, name: str, layout: KVLayout, counts: list[int], rounds: int,
             backend: machine.Device, rng: random.Random) -> dict[tuple[int, str], list[int]]:  # fmt: skip
    """One pool of ``layout`` over two devices, every variant and size timed in interleaved rounds (ns)."""
    import torch

    from kvpool.client import PoolClient
    from kvpool.transfer import copy_blocks

    per_block = layout.block_nbytes
    num_blocks = 3 * max(counts) + 16 + layout.reserved_blocks
    samples: dict[tuple[int, str], list[int]] = {(n, v): [] for n in counts for v in VARIANTS}
    flags = ["--devices", "0,1", "--num-blocks", str(num_blocks), *harness.layout_flags(layout)]
    with harness.start_pool(backend, *flags) as pool, PoolClient(pool.url, name="copy-bench") as client:
        a0, a1 = client.arena(device=0), client.arena(device=1)
        devs = [a0.device, a1.device]
        _check(client, a0, a1)
        spare = max(counts) + 8  # room for the move variant's fresh blocks on both arenas
        src_all = client.alloc(num_blocks - layout.reserved_blocks - spare, device=0)
        dst_all = client.alloc(num_blocks - layout.reserved_blocks - spare, device=1)
        src_buf = torch.empty(max(counts) * per_block, dtype=torch.uint8, device=a0.device)
        dst_buf = torch.empty_like(src_buf, device=a1.device)
        total = len(counts) * (rounds + 1) * len(VARIANTS)
        with harness.progress(total, f"copy {name}", args.no_progress) as bar:
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
    return samples


def _check(client: Any, a0: Any, a1: Any) -> None:
    """One copy's bytes, checked: a figure of a wrong copy would be worth nothing."""
    import torch

    from kvpool.transfer import copy_blocks

    src, dst = client.alloc(4, device=0), client.alloc(4, device=1)
    view0, dim = a0.blocks_view()
    idx0 = torch.tensor(a0.local_ids(src), device=a0.device)
    payload = torch.randn(view0.index_select(dim, idx0).shape, device=a0.device).to(view0.dtype)
    view0.index_copy_(dim, idx0, payload)
    done = copy_blocks(a0, src, a1, dst)
    if done is not None:
        done.synchronize()
    got = a1.blocks_view()[0].index_select(dim, torch.tensor(a1.local_ids(dst), device=a1.device))
    if not torch.equal(got.cpu(), payload.cpu()):
        raise SystemExit("copy: the copied blocks differ from the source")
    client.free(src + dst)


def _row(report: harness.Report, layout: str, n: int, v: str) -> dict[str, Any]:
    return next(r for r in report.results if (r["layout"], r["blocks"], r["variant"]) == (layout, n, v))


def _targets(report: harness.Report, two_gpus: bool) -> None:
    for layout, counts in report.config["blocks"].items():
        for n in counts:
            blocks, peer = _row(report, layout, n, "blocks"), _row(report, layout, n, "peer-copy")
            ratio = blocks["gb_per_s_p50"] / peer["gb_per_s_p50"]
            report.targets.append(
                harness.Target(
                    f"{layout}: scattered blocks / plain peer copy ({harness.fmt_bytes(blocks['bytes'])}, {n} blocks)",
                    f">= {GOAL}x",
                    f"{ratio:.2f}x ({blocks['gb_per_s_p50']:.0f} vs {peer['gb_per_s_p50']:.0f} GB/s)",
                    ratio >= GOAL if two_gpus else None,
                )
            )


def _body(report: harness.Report) -> str:
    rows = []
    for layout, counts in report.config["blocks"].items():
        per_block = LAYOUTS[layout].block_nbytes
        for n in counts:
            cells = [layout, harness.fmt_bytes(n * per_block), str(n)]
            for v in VARIANTS:
                r = _row(report, layout, n, v)
                cells.append(f"{harness.fmt_us(r['p50_us'])} ({r['gb_per_s_p50']:.0f} GB/s)")
            rows.append(cells)
    head = ["layout", "KV", "blocks", *(f"{v} p50" for v in VARIANTS)]
    cfg = report.config
    return (f"Copy between two arenas ({cfg['arenas']}), p50 of {cfg['rounds']}:\n"
            + harness.table(head, rows))  # fmt: skip


def _plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for layout in report.config["blocks"]:
        for v in VARIANTS:
            rows = [r for r in report.results if r["layout"] == layout and r["variant"] == v]
            ax.plot([r["bytes"] / MIB for r in rows], [r["gb_per_s_p50"] for r in rows], marker="o",
                    label=f"{layout}: {v}")  # fmt: skip
    ax.set(xscale="log", title="copy between arenas (p50)", xlabel="KV (MiB)", ylabel="GB/s")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.suptitle(f"kvpool copy ({machine.describe_device(machine.device_info(report.device))})")
    return fig
