"""A handoff between two pools (``--peers``: another node's pool) against raw NIXL READs of the same bytes.

Two pools start side by side, each listing the other as its peer; a producer parks N blocks on pool A, a
consumer claims them through pool B (``POST /remote/claim``), and B's NIXL agent reads them into B's arena. The
figure is B's own timing of that read (descriptors built, posted, polled until done), beside two READs of the same
bytes, as the same spans, by NIXL agents with no pool around them: one from A's arena into a buffer of this
process's (the transfer engine on the arena's memory), one between two plain buffers (``torch.empty``: cudaMalloc
memory on GPUs), the first in a child process as A is. Also printed: descriptors per handoff beside the runs of ids
it is (times the spans of a block in the arena's order), and what memory each arena is (VMM, and whether it was
allocated GPUDirect RDMA-capable).

Without a GPU both arenas are host memory and UCX moves the bytes over TCP (or shared memory) on this machine;
with two GPUs (--gpu 0 --peer-gpu 1) the arenas are on two GPUs of one host. Neither is a second host: see
docs/across-nodes.md for what RDMA between hosts would add. Needs NIXL (kvpool[nixl]).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.layout import KVLayout

#: the pool's read; NIXL's READ of the same spans of A's arena; NIXL's READ between two plain buffers
VARIANTS = ("handoff", "raw_arena", "raw_buffers")

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
    parser.add_argument("--arena-handle", choices=["legacy", "vmm", "auto"], default="auto",
                        help="the GPU arenas' memory: vmm (allocated RDMA-capable where the GPU allows), legacy "
                        "(cudaMalloc), or auto: what kvpool serve --peers takes, legacy [auto]")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from kvpool.server.remote.nixlagent import load_nixl

    load_nixl()
    device = machine.resolve_device(args)
    layout = LAYOUTS["small" if args.quick else args.layout].model_copy(update={"order": args.order})
    counts = args.blocks or ([2, 8] if args.quick else [4, 16, 64])
    rounds = args.rounds or (3 if args.quick else 20)
    num_blocks = 2 * max(counts) + 8
    report = harness.Report("remote", args, device, {})
    gpu_b = args.peer_gpu if args.peer_gpu is not None else args.gpu
    report.config.update(blocks=counts, rounds=rounds, warmup_rounds=1, layout=layout.model_dump(),
                         arena_blocks=num_blocks, ucx_tls=os.environ.get("UCX_TLS"), gpus=[args.gpu, gpu_b],
                         arena_handle=args.arena_handle if device.is_cuda else None)  # fmt: skip
    if not device.is_cuda:
        report.notes.append("ran without a GPU: two host arenas on one machine, UCX over loopback, not a network")
    elif gpu_b == args.gpu:
        report.notes.append("both pools on one GPU: pass --peer-gpu for two")
    token = secrets.token_hex(16)
    pa, pb = harness.free_port(), harness.free_port()
    handle = ["--arena-handle", args.arena_handle] if device.is_cuda else []
    a = _pool("a", device, args.gpu, pa, pb, token, layout, num_blocks, handle)
    try:
        b = _pool("b", device, gpu_b, pb, pa, token, layout, num_blocks, handle)
        try:
            samples = _measure(report, device, args.gpu, gpu_b, pa, pb, token, counts, rounds, layout)
        finally:
            b.stop()
    finally:
        a.stop()
    for n in counts:
        for v in VARIANTS:
            stats = timings.summarize_ns(samples[(n, v)])
            gbps = n * layout.block_nbytes / (stats["p50_us"] * 1e-6) / 1e9
            report.results.append({"blocks": n, "bytes": n * layout.block_nbytes, "variant": v, "gb_per_s_p50": gbps,
                                   "descriptors": report.raw[f"descriptors_{n}"],
                                   "runs_x_spans": report.raw[f"runs_x_spans_{n}"], **stats})  # fmt: skip
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


def _measure(report: harness.Report, device: Any, gpu_a: int, gpu_b: int, pa: int, pb: int, token: str,
             counts: list[int], rounds: int, layout: KVLayout) -> dict[tuple[int, str], list[int]]:  # fmt: skip
    import httpx

    from kvpool.client import PoolClient
    from kvpool.remote_protocol import AgentInfo
    from kvpool.runs import Geometry, paired_runs

    auth = {"authorization": f"Bearer {token}"}
    a_url, b_url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    info = AgentInfo.model_validate(httpx.get(a_url + "/remote/agent", headers=auth).json())
    info_b = AgentInfo.model_validate(httpx.get(b_url + "/remote/agent", headers=auth).json())
    report.config["arenas"] = {"a": _memory(info), "b": _memory(info_b)}
    nbytes = max(counts) * layout.block_nbytes
    raw_agent, buf, base = _raw_agent(device, gpu_b, nbytes)
    source = _Source(device, gpu_a, nbytes)
    geometry = Geometry(info.base, info.num_blocks, info.layout)
    spans_per_block = len(geometry.spans(0, 1))
    samples: dict[tuple[int, str], list[int]] = {(n, v): [] for n in counts for v in VARIANTS}
    try:
        arena_peer = raw_agent.connect(info.metadata)
        buffers_peer = raw_agent.connect(source.metadata)
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
                    a_ids = [i & 0xFFFFFFFF for i in ids]
                    report.raw[f"descriptors_{n}"] = got["descriptors"]
                    report.raw[f"runs_x_spans_{n}"] = len(paired_runs(a_ids, a_ids)) * spans_per_block
                    if not _contiguous(a_ids):
                        continue
                    spans = geometry.spans(a_ids[0] - info.first_block, n)
                    took = _raw_read(raw_agent, arena_peer, base, spans, info.memory)
                    took_plain = _raw_read(raw_agent, buffers_peer, base, _packed(source.base, spans), source.memory)
                    if r:
                        samples[(n, "handoff")].append(int(got["read_s"] * 1e9))
                        samples[(n, "raw_arena")].append(took)
                        samples[(n, "raw_buffers")].append(took_plain)
    finally:
        raw_agent.close()
        source.close()
    del buf
    return samples


def _memory(info: Any) -> str:
    if info.memory == "DRAM":
        return "host memory"
    if info.gpu_direct_rdma is None:
        return f"GPU {info.device}, cudaMalloc"
    return f"GPU {info.device}, VMM, gpuDirectRDMACapable={'yes' if info.gpu_direct_rdma else 'no (the GPU lacks it)'}"


def _contiguous(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def _raw_agent(device: Any, gpu: int, nbytes: int) -> tuple[Any, Any, int]:
    import torch

    from kvpool.server.remote.nixlagent import NixlAgent

    if device.is_cuda:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        return NixlAgent(f"raw-{secrets.token_hex(4)}", buf.data_ptr(), nbytes, "VRAM", gpu), buf, buf.data_ptr()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    return NixlAgent(f"raw-{secrets.token_hex(4)}", buf.data_ptr(), nbytes, "DRAM", 0), buf, buf.data_ptr()


READY = b"kvpool-buffer-ready "


class _Source:
    """A plain buffer (``torch.empty``: cudaMalloc memory on a GPU) registered with a NIXL agent in a child
    process, as pool A's arena is in A's: the raw READ between two plain buffers crosses processes as the
    handoff does."""

    def __init__(self, device: Any, gpu: int, nbytes: int) -> None:
        self.memory = "VRAM" if device.is_cuda else "DRAM"
        code = f"from kvpool.benchmarks.remote import serve_buffer; serve_buffer({nbytes}, {gpu}, {self.memory!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=harness.child_env())  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL writes its own lines to stdout too
            if line.startswith(READY):
                break
        else:
            self.proc.wait(30)
            raise RuntimeError(f"the raw READ's source process exited ({self.proc.returncode}) before it was ready")
        got = json.loads(line[len(READY) :])
        self.metadata, self.base = str(got["metadata"]), int(got["base"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve_buffer(nbytes: int, gpu: int, memory: str) -> None:
    """The source of the raw READ between plain buffers: allocate, register, say where, wait for stdin to end."""
    import torch

    from kvpool.server.remote.nixlagent import NixlAgent

    on_gpu = memory == "VRAM"
    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}" if on_gpu else "cpu")
    agent = NixlAgent(f"buffer-{secrets.token_hex(4)}", buf.data_ptr(), nbytes, memory, gpu if on_gpu else 0)  # type: ignore[arg-type]
    print(READY.decode() + json.dumps({"metadata": agent.metadata(), "base": buf.data_ptr()}), flush=True)
    sys.stdin.read()
    agent.close()


def _packed(base: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans of the same sizes, one after another from ``base``."""
    out, at = [], base
    for _, n in spans:
        out.append((at, n))
        at += n
    return out


def _raw_read(agent: Any, peer: str, base: int, spans: list[tuple[int, int]], memory: str) -> int:
    """ns from post to done of a READ of ``spans`` into this process's buffer, packed, busy-polled."""
    local = _packed(base, spans)
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
    ours, raw = _row(report, n, "handoff"), _row(report, n, "raw_buffers")
    ratio = raw["p50_us"] / ours["p50_us"]
    report.targets.append(harness.Target(
        f"handoff read vs raw NIXL READ between plain buffers ({harness.fmt_bytes(ours['bytes'])})", ">= 0.9x",
        f"{harness.fmt_us(ours['p50_us'])} vs {harness.fmt_us(raw['p50_us'])} ({ratio:.2f}x)",
        ratio >= 0.9 if report.device.is_cuda else None,
    ))  # fmt: skip
    worst = max(report.config["blocks"], key=lambda k: _row(report, k, "handoff")["descriptors"])
    row = _row(report, worst, "handoff")
    report.targets.append(harness.Target(
        "descriptors per handoff vs its runs x spans of a block", "at most",
        f"{row['descriptors']} vs {row['runs_x_spans']} ({worst} blocks)", row["descriptors"] <= row["runs_x_spans"],
    ))  # fmt: skip


def _body(report: harness.Report) -> str:
    rows = []
    for n in report.config["blocks"]:
        ours, arena, plain = (_row(report, n, v) for v in VARIANTS)
        rows.append([harness.fmt_bytes(ours["bytes"]), str(n), harness.fmt_us(ours["p50_us"]),
                     f"{ours['gb_per_s_p50']:.3g}", harness.fmt_us(plain["p50_us"]), f"{plain['gb_per_s_p50']:.3g}",
                     f"{plain['p50_us'] / ours['p50_us']:.2f}x", harness.fmt_us(arena["p50_us"]),
                     f"{ours['descriptors']} / {ours['runs_x_spans']}"])  # fmt: skip
    head = ["KV", "blocks", "handoff read p50", "GB/s", "raw READ, buffers", "GB/s", "buffers/handoff",
            "raw READ, arena", "descriptors / runs x spans"]  # fmt: skip
    arenas = report.config.get("arenas", {})
    where = f"pool A: {arenas.get('a')}; pool B: {arenas.get('b')}; raw buffers: torch.empty on each side"
    return f"A handoff read from a peer pool, p50 of {report.config['rounds']}:\n{where}\n{harness.table(head, rows)}"
