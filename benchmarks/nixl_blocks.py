"""One request's KV read by NIXL from another process, laid out as vLLM's NixlConnector lays it out, beside the
copy kvpool's connector makes of the same blocks: the plain-NIXL side of the prefill/decode comparison.

    python -m kvpool.benchmarks.nixl_blocks [--device cuda] [--requests 32]     (needs NIXL: nixl-cu13 1.5.1)

Each of two processes holds a paged KV cache shaped as vLLM's TRITON_ATTN backend shapes it (16 layers; a block is
16 tokens x 8 KV heads x 64 dims, K and V side by side: 32 KiB per layer and block in bf16), registered with
NIXL's UCX backend. The consumer reads one request's 64 blocks with one descriptor per (layer, block), 1,024
descriptors (32 MiB), as the connector's transfer plan does (``remote_block_len=32768``), the descriptor lists
prepared once; each request is then one prepared transfer, timed from its post until NIXL says DONE, and every
byte is compared with the producer's. Then all requests posted at once (a burst). kvpool's handover of the same
blocks is a claim (a pool round trip, measured in the engines) and this copy: one gather per layer from the pool's
arena into the engine's blocks, timed here on the consumer's GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

LAYERS, BLOCK, HEADS, DIM, BLOCKS_PER_REQ = 16, 16, 8, 64, 64
SHAPE = (2, BLOCK, HEADS, DIM)
BLOCK_BYTES = 2 * BLOCK * HEADS * DIM * 2


def layers(num_blocks: int, device: str, fill: bool) -> list[torch.Tensor]:
    out = []
    for i in range(LAYERS):
        if fill:  # the same values on both sides, made on the CPU so that the device does not matter
            t = torch.randn((num_blocks, *SHAPE), generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            out.append(t.to(device))
        else:
            out.append(torch.zeros((num_blocks, *SHAPE), dtype=torch.bfloat16, device=device))
    return out


def agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def descs(kv: list[torch.Tensor], num_blocks: int, dev: int) -> list[tuple[int, int, int]]:
    """One (address, length, device) per (layer, block), layer-major."""
    return [(t.data_ptr() + b * BLOCK_BYTES, BLOCK_BYTES, dev) for t in kv for b in range(num_blocks)]


def producer(device: str, num_blocks: int, to_consumer: Any, stop: Any) -> None:
    kv = layers(num_blocks, device, fill=True)
    a = agent("producer")
    mem = "VRAM" if device.startswith("cuda") else "DRAM"
    a.register_memory(kv)
    dev = torch.device(device).index or 0
    to_consumer.put((a.get_agent_metadata(), descs(kv, num_blocks, dev), mem))
    stop.get()


def consumer(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks = args.requests * BLOCKS_PER_REQ
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=producer, args=(args.device, num_blocks, q, stop))
    p.start()
    try:
        kv = layers(num_blocks, args.device, fill=False)
        a = agent("consumer")
        a.register_memory(kv)
        meta, remote, mem = q.get(timeout=300)
        peer = a.add_remote_agent(meta)
        dev = torch.device(args.device).index or 0
        local_h = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(descs(kv, num_blocks, dev), mem))
        remote_h = a.prep_xfer_dlist(peer, a.get_xfer_descs(remote, mem))
        res: dict[str, Any] = {"device": torch.cuda.get_device_name() if mem == "VRAM" else "cpu", "memory": mem,
                               "descriptors_per_request": LAYERS * BLOCKS_PER_REQ,
                               "bytes_per_request": LAYERS * BLOCKS_PER_REQ * BLOCK_BYTES}  # fmt: skip

        def post(r: int) -> Any:
            idx = [layer * num_blocks + b for layer in range(LAYERS)
                   for b in range(r * BLOCKS_PER_REQ, (r + 1) * BLOCKS_PER_REQ)]  # fmt: skip
            h = a.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
            state = a.transfer(h)
            assert state != "ERR", "NIXL refused the transfer"
            return h

        def wait(h: Any) -> None:
            while (state := a.check_xfer_state(h)) == "PROC":
                pass
            assert state == "DONE", f"NIXL transfer ended {state}"
            a.release_xfer_handle(h)

        times = []
        for r in range(args.requests):
            t0 = time.perf_counter()
            wait(post(r))
            times.append((time.perf_counter() - t0) * 1e3)
        want = layers(num_blocks, "cpu", fill=True)
        res["bytes_identical"] = all(torch.equal(x.cpu(), y) for x, y in zip(kv, want, strict=True))
        res["one_at_a_time_ms"] = {"p50": round(statistics.median(times), 3), "min": round(min(times), 3),
                                   "max": round(max(times), 3), "first": round(times[0], 3)}  # fmt: skip
        for t in kv:
            t.zero_()
        t0 = time.perf_counter()
        for h in [post(r) for r in range(args.requests)]:
            wait(h)
        res["burst_ms_total"] = round((time.perf_counter() - t0) * 1e3, 3)
        res["burst_bytes_identical"] = all(torch.equal(x.cpu(), y) for x, y in zip(kv, want, strict=True))
        res["kvpool_gather_ms_per_request"] = gather(kv, args)
        return res
    finally:
        stop.put(None)
        p.join(60)


def gather(kv: list[torch.Tensor], args: argparse.Namespace) -> float | None:
    """The connector's load of one request's blocks (one gather per layer, arena -> engine blocks), GPU time."""
    if not args.device.startswith("cuda"):
        return None
    arena = [torch.empty_like(t) for t in kv]
    src = torch.arange(BLOCKS_PER_REQ, device=args.device)
    dst = src + BLOCKS_PER_REQ
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        for t, x in zip(kv, arena, strict=True):
            t.index_copy_(0, dst, x.index_select(0, src))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times[5:]), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", help="write the figures here as JSON too")
    args = ap.parse_args()
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")  # else UCX reads over TCP on a GPU without NVLink
    res = consumer(args)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
