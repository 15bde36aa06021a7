"""Decode throughput of the paged model: a batch of long sequences, one token each per step.

``python -m kvpool.workers.bench_decode`` (defaults: 32 sequences of 4096 tokens, a random model shaped like Llama 3.2
1B in bf16, block size 16) times whole decode steps, the same :func:`workers.sequence.decode_step` the decode
worker runs, over a private cache with the arena's geometry, and times the attention alone: the paged kernel
against the torch fallback that gathers the context. The contexts' K/V are random values written straight into
the blocks (prefilling 128k tokens would measure prefill, not decode). Block ids come from a local list, so the
figures leave out the pool's ``alloc`` (one call per step at most, for the sequences that cross into a new block).
It prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch
from kvpool.workers.attention import paged_decode_attention
from kvpool.workers.kvcache import layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel
from kvpool.workers.monolithic import LocalBlocks
from kvpool.workers.sequence import Sequence as Seq
from kvpool.workers.sequence import blocks_needed, decode_step

PRESETS = {
    "llama-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
    ),
    "llama-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
    ),
    "tiny": LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.workers.bench_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--order", choices=["layer_major", "block_major"], default="layer_major")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = PRESETS[args.preset]
    layout = layout_for(config, args.block_size, args.dtype, args.order)
    per_seq = blocks_needed(args.context + args.steps + 8, args.block_size)
    num_blocks = args.batch * per_seq
    caches = private_kv_caches(layout, num_blocks, device)
    for k_cache, v_cache in caches:
        k_cache.normal_()
        v_cache.normal_()
    model = LlamaModel.random(config, seed=0, device=device, dtype=dtype)
    blocks = LocalBlocks(num_blocks)
    gen = torch.Generator().manual_seed(0)
    seqs = [
        Seq(
            request_id=str(i),
            prompt_len=args.context,
            block_ids=blocks.alloc(blocks_needed(args.context, args.block_size)),
            output=[int(torch.randint(config.vocab_size, (1,), generator=gen))],
            max_new_tokens=1 << 30,
        )
        for i in range(args.batch)
    ]

    def step() -> None:
        decode_step(model, caches, seqs, blocks, args.block_size)

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()  # ends in .tolist(): the host waits for every step
    elapsed = time.perf_counter() - t0

    # attention alone, one layer, over the contexts as they now stand
    k_cache, v_cache = caches[0]
    width = max(len(s.block_ids) for s in seqs)
    tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], dtype=torch.int32)
    tables = tables.to(device)
    lens = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32, device=device)
    max_len = max(s.num_cached for s in seqs)
    q = torch.randn(args.batch, config.num_attention_heads, config.head_dim, device=device, dtype=dtype)
    attention = {}
    for backend in ("auto", "torch"):
        attention[backend] = timed(
            lambda b=backend: paged_decode_attention(
                q, k_cache, v_cache, tables, lens, config.head_dim**-0.5, max_context_len=max_len, backend=b
            ),
            device,
            repeat=20,
        )
    kv_bytes = 2 * int(lens.sum()) * config.num_key_value_heads * config.head_dim * layout.itemsize
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "device": name,
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": args.dtype,
        "batch": args.batch,
        "context": args.context,
        "block_size": args.block_size,
        "order": args.order,
        "steps": args.steps,
        "decode_tokens_per_s": round(args.batch * args.steps / elapsed, 1),
        "ms_per_step": round(1e3 * elapsed / args.steps, 3),
        "attention_layer_ms": round(1e3 * attention["auto"], 4),
        "attention_layer_ms_torch_gather": round(1e3 * attention["torch"], 4),
        "attention_kv_read_gb_per_s": round(kv_bytes / attention["auto"] / 1e9, 1),
        "attention_backend": "triton" if device.type == "cuda" else "torch",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
