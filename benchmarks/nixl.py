"""What a prefill/decode pair without kvpool moves: one request's KV read by NIXL from another process, laid out as
vLLM's NixlConnector lays it out (one descriptor per layer and block), for ``kvpool bench vllm`` to set beside the
decode engine's handover in the same run.

Two processes on one GPU each hold a paged KV cache of vLLM's shape (per layer, blocks of ``block_size`` tokens x
KV heads x K and V side by side), registered with NIXL's UCX backend; the consumer reads each request's blocks with
one prepared transfer, timed from its post until NIXL says DONE, and checks every byte. Needs NIXL (nixl-cu13).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import time
from typing import Any


def nixl_api() -> Any | None:
    """NIXL's Python API, under whichever name this install gives it; None without NIXL."""
    for name in ("nixl._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _caches(layers: int, blocks: int, block_bytes: int, fill: bool) -> list[Any]:
    import torch

    out = []
    for i in range(layers):
        if fill:  # the same bytes on both sides, made on the CPU
            g = torch.Generator().manual_seed(i)
            out.append(torch.randint(0, 255, (blocks, block_bytes), generator=g, dtype=torch.uint8).cuda())
        else:
            out.append(torch.zeros((blocks, block_bytes), dtype=torch.uint8, device="cuda"))
    return out


def _descs(kv: list[Any], block_bytes: int) -> list[tuple[int, int, int]]:
    dev = kv[0].device.index or 0
    return [(t.data_ptr() + b * block_bytes, block_bytes, dev) for t in kv for b in range(t.shape[0])]


def _agent(api: Any, name: str) -> Any:
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _producer(shape: tuple[int, int, int], to_consumer: Any, stop: Any) -> None:
    api = nixl_api()
    layers, blocks, block_bytes = shape
    kv = _caches(layers, blocks, block_bytes, fill=True)
    a = _agent(api, "producer")
    a.register_memory(kv)
    to_consumer.put((a.get_agent_metadata(), _descs(kv, block_bytes)))
    stop.get()


def read_requests(layers: int, blocks_per_request: int, block_bytes: int, requests: int) -> dict[str, Any]:
    """p50 (and min, max) of reading one request's blocks, ``requests`` times, one at a time; bytes checked."""
    import torch

    api = nixl_api()
    if api is None:
        return {"skipped": "NIXL is not installed (nixl-cu13)"}
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")  # else UCX reads over TCP on a GPU without NVLink
    blocks = requests * blocks_per_request
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_producer, args=((layers, blocks, block_bytes), q, stop))
    p.start()
    try:
        kv = _caches(layers, blocks, block_bytes, fill=False)
        a = _agent(api, "consumer")
        a.register_memory(kv)
        meta, remote = q.get(timeout=300)
        peer = a.add_remote_agent(meta)
        local_h = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(_descs(kv, block_bytes), "VRAM"))
        remote_h = a.prep_xfer_dlist(peer, a.get_xfer_descs(remote, "VRAM"))
        times = []
        for r in range(requests):
            idx = [layer * blocks + b for layer in range(layers)
                   for b in range(r * blocks_per_request, (r + 1) * blocks_per_request)]  # fmt: skip
            t0 = time.perf_counter()
            h = a.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
            if a.transfer(h) == "ERR":
                raise RuntimeError("NIXL refused the transfer")
            while (state := a.check_xfer_state(h)) == "PROC":
                pass
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")
            times.append((time.perf_counter() - t0) * 1e6)
            a.release_xfer_handle(h)
        want = _caches(layers, blocks, block_bytes, fill=True)
        same = all(torch.equal(x, y) for x, y in zip(kv, want, strict=True))
        return {
            "read_p50_us": round(statistics.median(times), 1), "read_min_us": round(min(times), 1),
            "read_max_us": round(max(times), 1), "requests": requests, "descriptors": layers * blocks_per_request,
            "bytes": layers * blocks_per_request * block_bytes, "bytes_identical": same,
        }  # fmt: skip
    finally:
        stop.put(None)
        p.join(60)
