"""The connector's block copies: the torch loop (a gather and a scatter per layer and K/V) against one Triton
launch for all layers, host time (what the engine's thread spends launching) and GPU time.

    python -m kvpool.benchmarks.vllm_copies [--blocks 1536] [--layers 16] [--iters 50]

The caches are shaped as vLLM's TRITON_ATTN shapes a Llama-3.2-1B's (``[blocks, 8 heads, 16, 2 x 64]``, bf16), the
arena's as the pool's NHD views; the block ids are a random permutation. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvpool.integrations.vllm.kvviews import BlockCopier, kv_views
from kvpool.layout import KVLayout


def measure(copier: BlockCopier, op: str, src: list[int], dst: list[int], iters: int) -> dict[str, float]:
    fn = getattr(copier, op)
    host, gpu = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn(src, dst)
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            host.append((t1 - t0) * 1e3)
            gpu.append(start.elapsed_time(end))
    return {"host_ms_p50": round(statistics.median(host), 4), "gpu_ms_p50": round(statistics.median(gpu), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    layout = KVLayout(num_layers=args.layers, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16")
    n = args.blocks
    caches = [torch.randn(2 * n, 8, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    arena = [torch.randn(2, 2 * n, 16, 8, 64, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    eng = [kv_views(c, layout) for c in caches]
    ar = [(a[0], a[1]) for a in arena]
    perm = torch.randperm(2 * n)
    src, dst = perm[:n].tolist(), perm[n:].tolist()
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "blocks": n, "layers": args.layers}
    for name, kernel in (("torch_loop", False), ("one_launch", True)):
        c = BlockCopier(eng, ar, kernel=kernel)
        out[name] = {op: measure(c, op, src, dst, args.iters) for op in ("load", "save")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
