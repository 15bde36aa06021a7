"""attach: how long a new worker process takes to map the arena, as the arena grows.

Each trial is a fresh process (``python -m kvpool.benchmarks.attach URL``) that has imported torch, kvpool and httpx's
transport and, on CUDA, made its context (a worker has all of them long before it attaches; their costs do not
depend on the arena and are reported apart), then times: opening a session (``PoolClient(...)``: its HTTP client,
whose default TLS context loads the CA bundle even for a Unix socket, and ``POST /sessions``), mapping the arena
(``client.arena()``: descriptor, then for a VMM arena its fd over the fast channel and
``cuMemImportFromShareableHandle`` + ``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess``, for a legacy one
``cudaIpcOpenMemHandle``, on CPU ``mmap`` of the /dev/shm file; then the per-layer views) and
touching the arena's last byte (``.item()``, so on CUDA the mapping is really usable). Arenas of 1 GiB to 64 GiB
on GPU, 1 to 8 GiB on CPU (capped by ``--max-bytes`` and by /dev/shm's free space).

Sizes are interleaved trial by trial when all their pools fit at once (GPU memory or /dev/shm); otherwise each
size gets its own pool in turn, and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

GIB = 1 << 30
MIB = 1 << 20
TARGET_S = 0.050
VMM_TARGET_S = 0.005  # issue 20: descriptor, fd, import, map and access of a 64 GiB VMM arena
PHASES = ("session", "map", "touch")
# The attach arenas' layout: 2 MiB blocks (32 layers, 8 KV heads, head dim 128, fp16, 16 tokens a block).
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", type=harness.size_list, default=None, help="arena sizes [GPU 1GiB..64GiB x2; CPU 1GiB..8GiB x2]"
    )
    parser.add_argument("--max-bytes", type=harness.parse_size, default=None, help="drop sizes above this")
    parser.add_argument(
        "--arena-handle", choices=["auto", "vmm", "legacy"], default=None,
        help="the pools' --arena-handle (CUDA): vmm maps an fd fetched over the fast channel [the pool's default]",
    )  # fmt: skip


def child(url: str, device: str) -> None:
    """The measured process: prints one JSON line of phase times (ns)."""
    t_start = time.perf_counter_ns()
    import httpcore  # noqa: F401 - httpx imports its transport lazily, at the first client: a one-time import cost
    import torch

    from kvpool.client import PoolClient

    t_import = time.perf_counter_ns()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)
    t_ctx = time.perf_counter_ns()
    client = PoolClient(url, name="attach", heartbeat=False)
    t_session = time.perf_counter_ns()
    arena = client.arena()
    t_map = time.perf_counter_ns()
    last = int(arena.raw[arena.raw.numel() - 1].item())
    t_touch = time.perf_counter_ns()
    client.close()
    out = {
        "import": t_import - t_start,
        "cuda_context": t_ctx - t_import,
        "session": t_session - t_ctx,
        "map": t_map - t_session,
        "touch": t_touch - t_map,
        "total": t_touch - t_ctx,
        "nbytes": arena.descriptor.nbytes,
        "backend": arena.descriptor.backend,
        "handle_kind": arena.descriptor.handle_kind,
        "last_byte": last,
    }
    print(json.dumps(out), flush=True)


def _trial(url: str, device: machine.Device) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.benchmarks.attach", url, device.torch_device],
        capture_output=True,
        text=True,
        env=harness.child_env(),
        cwd=machine.ROOT,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the attaching process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _room(device: machine.Device) -> tuple[int, str]:
    """Bytes that arenas may take here: free GPU memory, or free space in /dev/shm."""
    if device.is_cuda:
        import torch

        free, _ = torch.cuda.mem_get_info(device.index)
        return free, "free GPU memory"
    return shutil.disk_usage("/dev/shm").free, "free space in /dev/shm"


def run(args: argparse.Namespace) -> int:
    device = machine.resolve_device(args)
    if args.sizes:
        sizes = args.sizes
    elif args.quick:
        sizes = [64 * MIB, 256 * MIB]
    else:
        top = 64 if device.is_cuda else 8
        sizes = [g * GIB for g in (1, 2, 4, 8, 16, 32, 64) if g <= top]
    room, what = _room(device)
    limit = min(args.max_bytes or room, int(room * 0.9))
    report = harness.Report("attach", args, device, {})
    dropped = [s for s in sizes if s > limit]
    sizes = sorted(s for s in sizes if s <= limit)
    if dropped:
        report.notes.append(
            f"skipped {', '.join(harness.fmt_bytes(s) for s in dropped)}: over --max-bytes or 90% of the "
            f"{harness.fmt_bytes(room)} of {what}"
        )
    if not sizes:
        raise SystemExit(f"attach: no arena size fits ({harness.fmt_bytes(room)} of {what})")
    rounds = args.rounds or (2 if args.quick else 5)
    together = sum(sizes) <= room * 0.5
    report.config.update(
        sizes=sizes, rounds=rounds, warmup_rounds=1, interleaved=together, pool_layout=LAYOUT.model_dump(), room=room
    )
    samples: dict[int, list[dict[str, int]]] = {s: [] for s in sizes}

    handle = ["--arena-handle", args.arena_handle] if args.arena_handle else []

    def pool_of(size: int) -> harness.Server:
        return harness.start_pool(device, *harness.layout_flags(LAYOUT), "--arena-bytes", str(size), *handle)

    with harness.progress(len(sizes) * (rounds + 1), "attach", args.no_progress) as bar:
        if together:
            with harness.servers(*(lambda s=s: pool_of(s) for s in sizes)) as pools:
                for r in range(rounds + 1):
                    for size, pool in timings.rotated(list(zip(sizes, pools, strict=True)), r):
                        result = _trial(pool.url, device)
                        bar.update()
                        if r:
                            samples[size].append(result)
        else:
            for size in sizes:
                with pool_of(size) as pool:
                    for r in range(rounds + 1):
                        result = _trial(pool.url, device)
                        bar.update()
                        if r:
                            samples[size].append(result)

    _summarize(report, samples, sizes)
    report.print_block("attach", _body(report, sizes))
    report.save(lambda: _plot(report, sizes))
    return 0


def _summarize(report: harness.Report, samples: dict[int, list[dict[str, int]]], sizes: list[int]) -> None:
    for size in sizes:
        trials = samples[size]
        row: dict[str, Any] = {"arena_bytes": size, "mapped_bytes": trials[0]["nbytes"]}
        row["handle_kind"] = trials[0].get("handle_kind")
        for key in ("total", *PHASES, "cuda_context", "import"):
            stats = timings.summarize_ns([t[key] for t in trials])
            row.update({f"{key}_{k}": v for k, v in stats.items() if k != "n"})
        row["n"] = len(trials)
        report.results.append(row)
        report.raw[str(size)] = trials
    big = report.results[-1]
    small = report.results[0]
    report.targets.append(
        harness.Target(
            f"attach {harness.fmt_bytes(big['arena_bytes'])} (p50)",
            f"< {TARGET_S * 1e3:.0f} ms",
            harness.fmt_us(big["total_p50_us"]),
            big["total_p50_us"] < TARGET_S * 1e6,
            "" if big["arena_bytes"] >= 64 * GIB else "the goal is stated for 64 GiB on GPU",
        )
    )
    if big["handle_kind"] == "vmm":
        report.targets.append(
            harness.Target(
                f"map a {harness.fmt_bytes(big['arena_bytes'])} VMM arena (p50)",
                f"<= {VMM_TARGET_S * 1e3:.0f} ms",
                harness.fmt_us(big["map_p50_us"]),
                big["map_p50_us"] <= VMM_TARGET_S * 1e6,
                "" if big["arena_bytes"] >= 64 * GIB else "the goal is stated for 64 GiB",
            )
        )
    ratio = big["total_p50_us"] / small["total_p50_us"]
    span = f"{harness.fmt_bytes(big['arena_bytes'])} vs {harness.fmt_bytes(small['arena_bytes'])}"
    report.targets.append(
        harness.Target(
            f"flat in arena size ({span})",
            "about 1x",
            f"{ratio:.2f}x",
            None,
        )
    )


def _body(report: harness.Report, sizes: list[int]) -> str:
    rows = [
        [
            harness.fmt_bytes(r["arena_bytes"]),
            f"{harness.fmt_us(r['total_p50_us'])} / {harness.fmt_us(r['total_max_us'])}",
            *(harness.fmt_us(r[f"{p}_p50_us"]) for p in PHASES),
            harness.fmt_us(r["cuda_context_p50_us"]),
            harness.fmt_us(r["import_p50_us"]),
        ]
        for r in report.results
    ]
    head = ["arena", "total p50 / max", "session", "map", "touch", "cuda ctx (apart)", "imports (apart)"]
    mode = "interleaved" if report.config["interleaved"] else "one pool at a time"
    kind = report.results[0].get("handle_kind")
    title = f"Attach of a new process ({kind} arena), p50 of {report.config['rounds']} ({mode}):\n"
    return title + harness.table(head, rows)


def _plot(report: harness.Report, sizes: list[int]) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [harness.fmt_bytes(r["arena_bytes"]) for r in report.results]
    bottom = [0.0] * len(labels)
    for phase in PHASES:
        values = [r[f"{phase}_p50_us"] / 1e3 for r in report.results]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(TARGET_S * 1e3, color="grey", lw=0.8, ls="--", label="goal (64 GiB, GPU)")
    ax.set(title="attach: session + map + touch (p50)", xlabel="arena", ylabel="ms")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"kvpool attach ({machine.describe_device(machine.device_info(report.device))})")
    return fig


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
