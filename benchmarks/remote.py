"""A handoff between two pools (``--peers``: another node's pool) against a raw NIXL READ of the same bytes.

Two pools start side by side, each listing the other as its peer; a producer parks N blocks on pool A, a
consumer claims them through pool B (``POST /remote/claim``), and B's NIXL agent reads them into B's arena. The
figure is B's own timing of that read (descriptors built, posted, polled until done), beside a READ of the same
bytes from A's arena, as the same spans (one descriptor in block_major order), by a NIXL agent of this process's:
what the transfer engine does with no pool around it. Also printed: descriptors per handoff (one per run of ids and
span of a block).

Without a GPU both arenas are host memory and UCX moves the bytes over TCP (or shared memory) on this machine;
with two GPUs (--gpu 0 --peer-gpu 1) the arenas are on two GPUs of one host. Neither is a second host: see
docs/across-nodes.md for what RDMA between hosts would add. Needs NIXL (kvpool[nixl]).
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

VARIANTS = ("handoff", "raw")

LAYOUTS = {
    "8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16", order="block_major"),
    "small": KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float16", order="block_major"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=harness.int_list, default=None, help="blocks per handoff [4,16,64]")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="8b", help="block shape [8b: 2 MiB blocks]")
    parser.add_argument("--order", choices=["block_major", "kv_packed", "layer_major"], default="block_major",
                        help="the arenas' order: spans per block, so descriptors per run [block_major: 1]")  # fmt: skip
    parser.add_argument("--peer-gpu", type=int, default=None, help="pool B's GPU [the same as --gpu]")
    parser.add_argument("--arena-handle", choices=["legacy", "vmm", "auto"], default="legacy",
                        help="the GPU arenas' memory: legacy is cudaMalloc; UCX reads VMM memory far slower unless "
                        "it is allocated RDMA-capable (docs/across-nodes.md) [legacy]")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from kvpool.server.nixlagent import load_nixl

    load_nixl()
    device = machine.resolve_device(args)
    layout = LAYOUTS["small" if args.quick else args.layout].model_copy(update={"order": args.order})
    counts = args.blocks or ([2, 8] if args.quick else [4, 16, 64])
    rounds = args.rounds or (3 if args.quick else 20)
    num_blocks = 2 * max(counts) + 8
    report = harness.Report("remote", args, device, {})
    report.config.update(blocks=counts, rounds=rounds, warmup_rounds=1, layout=layout.model_dump(),
                         arena_blocks=num_blocks, ucx_tls=os.environ.get("UCX_TLS"),
                         arena_handle=args.arena_handle if device.is_cuda else None)  # fmt: skip
    if not device.is_cuda:
        report.notes.append("ran without a GPU: two host arenas on one machine, UCX over loopback, not a network")
    token = secrets.token_hex(16)
    pa, pb = harness.free_port(), harness.free_port()
    gpu_b = args.peer_gpu if args.peer_gpu is not None else args.gpu
    handle = ["--arena-handle", args.arena_handle] if device.is_cuda else []
    a = _pool("a", device, args.gpu, pa, pb, token, layout, num_blocks, handle)
    try:
        b = _pool("b", device, gpu_b, pb, pa, token, layout, num_blocks, handle)
        try:
            samples = _measure(report, device, gpu_b, pa, pb, token, counts, rounds, layout)
        finally:
            b.stop()
    finally:
        a.stop()
    for n in counts:
        for v in VARIANTS:
            stats = timings.summarize_ns(samples[(n, v)])
            gbps = n * layout.block_nbytes / (stats["p50_us"] * 1e-6) / 1e9
            report.results.append({"blocks": n, "bytes": n * layout.block_nbytes, "variant": v, "gb_per_s_p50": gbps,
                                   "descriptors": report.raw[f"descriptors_{n}"], **stats})  # fmt: skip
    _targets(report)
    report.print_block("remote", _body(report))
    report.save(lambda: harness.bandwidth_plot(report, VARIANTS, "peer pool -> pool read (p50)", "remote"))
    return 0


def _pool(name: str, device: Any, gpu: int, port: int, peer: int, token: str, layout: KVLayout, blocks: int,
          extra: list[str]) -> Any:  # fmt: skip
    from kvpool.server import launch

    workdir = Path(tempfile.mkdtemp(prefix=f"kvb-{name}-"))
    sock = workdir / "s.sock"
    argv = ["kvpool", "serve", "--backend", device.backend, "--device", str(gpu), "--log-level", "warning",
            "--lease-ttl-s", "3600", "--handoff-ttl-s", "3600", "--num-blocks", str(blocks),
            *harness.layout_flags(layout), "--peers", f"http://127.0.0.1:{peer}", "--token", token,
            "--socket", str(sock), "--port", str(port), *extra]  # fmt: skip
    return launch.spawn(argv, socket=sock, port=port, log=workdir / f"{name}.log", env=harness.child_env(),
                        timeout_s=300, workdir=workdir)  # fmt: skip


def _measure(report: harness.Report, device: Any, gpu_b: int, pa: int, pb: int, token: str, counts: list[int],
             rounds: int, layout: KVLayout) -> dict[tuple[int, str], list[int]]:  # fmt: skip
    import httpx

    from kvpool.client import PoolClient
    from kvpool.remote_protocol import AgentInfo
    from kvpool.runs import Geometry

    auth = {"authorization": f"Bearer {token}"}
    a_url, b_url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    info = AgentInfo.model_validate(httpx.get(a_url + "/remote/agent", headers=auth).json())
    raw_agent, buf, base = _raw_agent(device, gpu_b, max(counts) * layout.block_nbytes)
    peer = raw_agent.connect(info.metadata)
    geometry = Geometry(info.base, info.num_blocks, info.layout)
    samples: dict[tuple[int, str], list[int]] = {(n, v): [] for n in counts for v in VARIANTS}
    with (
        PoolClient(a_url, name="prefill", token=token) as prefill,
        PoolClient(b_url, name="decode", token=token) as dec,
    ):
        for r in range(rounds + 1):
            for n in timings.rotated(counts, r):
                ids = prefill.alloc(n)
                rid = f"r{r}-{n}"
                prefill.handoff(rid, ids, num_tokens=n * layout.block_size)
                body = {"session_id": dec.session_id, "request_id": rid, "peer": a_url, "timeout_s": 10}
                got = httpx.post(b_url + "/remote/claim", json=body, headers=auth, timeout=60).json()
                dec.free(got["block_ids"])
                report.raw[f"descriptors_{n}"] = got["descriptors"]
                first = ids[0] & 0xFFFFFFFF
                spans = geometry.spans(first - info.first_block, n) if _contiguous(ids) else []
                took = _raw_read(raw_agent, peer, base, spans, info.memory) if spans else None
                if r and took is not None:
                    samples[(n, "handoff")].append(int(got["read_s"] * 1e9))
                    samples[(n, "raw")].append(took)
    raw_agent.close()
    del buf
    return samples


def _contiguous(ids: list[int]) -> bool:
    blocks = [i & 0xFFFFFFFF for i in ids]
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def _raw_agent(device: Any, gpu: int, nbytes: int) -> tuple[Any, Any, int]:
    import torch

    from kvpool.server.nixlagent import NixlAgent

    if device.is_cuda:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        return NixlAgent(f"raw-{secrets.token_hex(4)}", buf.data_ptr(), nbytes, "VRAM", gpu), buf, buf.data_ptr()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    return NixlAgent(f"raw-{secrets.token_hex(4)}", buf.data_ptr(), nbytes, "DRAM", 0), buf, buf.data_ptr()


def _raw_read(agent: Any, peer: str, base: int, spans: list[tuple[int, int]], memory: str) -> int:
    """ns from post to done of a READ of ``spans`` into this process's buffer, packed, busy-polled."""
    local, at = [], base
    for _, n in spans:
        local.append((at, n))
        at += n
    t0 = time.perf_counter_ns()
    handle = agent.post_read(peer, local, spans, memory)
    while (state := agent.state(handle))[0] == "PROC":
        pass
    took = time.perf_counter_ns() - t0
    agent.release(handle)
    if state[0] != "DONE":
        raise RuntimeError(f"the raw NIXL READ failed: {state[1]}")
    return took


def _row(report: harness.Report, n: int, v: str) -> dict[str, Any]:
    return next(r for r in report.results if r["blocks"] == n and r["variant"] == v)


def _targets(report: harness.Report) -> None:
    n = report.config["blocks"][-1]
    ours, raw = _row(report, n, "handoff"), _row(report, n, "raw")
    ratio = raw["p50_us"] / ours["p50_us"]
    report.targets.append(harness.Target(
        f"handoff read vs raw NIXL READ ({harness.fmt_bytes(ours['bytes'])})", ">= 0.9x",
        f"{harness.fmt_us(ours['p50_us'])} vs {harness.fmt_us(raw['p50_us'])} ({ratio:.2f}x)",
        ratio >= 0.9 if report.device.is_cuda else None,
    ))  # fmt: skip


def _body(report: harness.Report) -> str:
    rows = []
    for n in report.config["blocks"]:
        ours, raw = _row(report, n, "handoff"), _row(report, n, "raw")
        rows.append([harness.fmt_bytes(ours["bytes"]), str(n), harness.fmt_us(ours["p50_us"]),
                     harness.fmt_us(raw["p50_us"]), f"{raw['p50_us'] / ours['p50_us']:.2f}x",
                     f"{ours['gb_per_s_p50']:.2f}", str(ours["descriptors"])])  # fmt: skip
    head = ["KV", "blocks", "handoff read p50", "raw READ p50", "raw/handoff", "GB/s", "descriptors"]
    return f"A handoff read from a peer pool, p50 of {report.config['rounds']}:\n{harness.table(head, rows)}"
