"""decode: the workers' decode step against its memory-bandwidth floor, a batch of long sequences, one token each.

Defaults: 32 sequences of 4096 tokens, a random model shaped like Llama 3.2 1B in bf16, block size 16 (--quick:
the workers' tiny model, 4 short sequences). It times whole decode steps, the same DecodeEngine step (one CUDA
graph replay on a GPU) that the decode worker and the monolithic generator run, over a private cache with the
arena's geometry. The contexts' K/V are random values written straight into the blocks (prefilling 128k tokens
would measure prefill, not decode). Block ids come from a local list, so the figures leave out the pool's alloc
(one call per step at most, for the sequences that cross into a new block).

The floor is the bytes a step must read (every weight once, every context's K and V once) over the bandwidth of
a large device-to-device copy measured in the same run (bytes read plus written, per second): no step can beat
it by much. Besides the step it times the graph replay alone (the GPU's share), the eager step (the same kernels
issued one by one) and the attention of one layer: the paged kernel against the torch fallback that gathers the
context. --profile prints the eager step's kernels by GPU time; --sweep times the paged kernel's split count and
tile shapes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from kvpool.benchmarks import harness, machine

PRESET_NAMES = ("llama-1b", "llama-8b", "tiny")


def presets() -> dict[str, Any]:
    """Random models by shape: Llama 3.2 1B and 3.1 8B, and a tiny one for a smoke run on the CPU."""
    from kvpool.workers.model import LlamaConfig

    return {
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


def timed(fn: Callable[[], object], device: Any, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, after one warm-up run."""
    import torch

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


def gpu_timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` by CUDA events (the GPU's time, not the host's), after two warm-up runs."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: Any, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and the bytes written."""
    import torch

    if device.type != "cuda":
        nbytes //= 8
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type != "cuda":
        return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeat=5)
    return 2 * nbytes / gpu_timed(lambda: dst.copy_(src), repeat=20)


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads: every layer, the final norm and the LM head (the embedding's
    rows for the batch's tokens are a rounding error, and a tied head is counted once)."""
    import torch

    tensors = [model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def profile_step(step: Callable[[], object], rows: int = 15) -> str:
    """The kernels of a few eager steps, by total GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def sweep_attention(q: Any, k_cache: Any, v_cache: Any, tables: Any, lens: Any) -> list[dict[str, object]]:
    """The paged kernel's GPU time per (splits, block_n, num_warps, num_stages), fastest first."""
    from kvpool.workers.triton_paged import paged_decode_attention_triton

    scale = q.shape[-1] ** -0.5
    rows = []
    for splits in (1, 2, 4, 8, 16):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):

                    def run(s: int = splits, bn: int = block_n, w: int = warps, st: int = stages) -> None:
                        paged_decode_attention_triton(
                            q, k_cache, v_cache, tables, lens, scale, num_splits=s, block_n=bn, num_warps=w,
                            num_stages=st,
                        )  # fmt: skip

                    try:
                        ms = 1e3 * gpu_timed(run, repeat=20)
                    except Exception as exc:  # a shape the compiler refuses (shared memory): note it, go on
                        rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages,
                                     "error": type(exc).__name__})  # fmt: skip
                        continue
                    rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages,
                                 "ms": round(ms, 4)})  # fmt: skip
    return sorted(rows, key=lambda r: float(r.get("ms", 1e9)))  # type: ignore[arg-type]


# -- the suite --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=PRESET_NAMES, default=None, help="random model's shape [llama-1b; quick tiny]"
    )
    parser.add_argument("--batch", type=int, default=None, help="sequences decoded together [32; quick 4]")
    parser.add_argument("--context", type=int, default=None, help="context tokens a sequence [4096; quick 128]")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps [64; quick 4]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--order", choices=["layer_major", "block_major"], default="layer_major")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="[GPU bfloat16, CPU float32]"
    )
    parser.add_argument("--profile", action="store_true", help="print the eager step's kernels by GPU time")
    parser.add_argument("--sweep", action="store_true", help="time the paged kernel's tuning knobs")
    parser.add_argument("--block-n", type=int, default=None, help="the paged kernel's tile (default: its own)")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.workers.attention import paged_decode_attention
    from kvpool.workers.engine import DecodeEngine
    from kvpool.workers.kvcache import layout_for, private_kv_caches
    from kvpool.workers.model import LlamaModel
    from kvpool.workers.monolithic import LocalBlocks
    from kvpool.workers.sequence import Sequence as Seq
    from kvpool.workers.sequence import blocks_needed, decode_step

    dev = machine.resolve_device(args)
    device = torch.device(dev.torch_device)
    quick = args.quick
    preset = args.preset or ("tiny" if quick else "llama-1b")
    batch, context = args.batch or (4 if quick else 32), args.context or (128 if quick else 4096)
    steps = args.steps or args.rounds or (4 if quick else 64)
    dtype_name = args.dtype or ("bfloat16" if dev.is_cuda else "float32")
    if args.block_n:
        from kvpool.workers import triton_paged

        triton_paged.BLOCK_N = args.block_n
    cfg = {"preset": preset, "batch": batch, "context": context, "steps": steps, "block_size": args.block_size,
           "order": args.order, "dtype": dtype_name, "block_n": args.block_n}  # fmt: skip
    report = harness.Report("decode", args, dev, cfg)

    dtype = getattr(torch, dtype_name)
    config = presets()[preset]
    layout = layout_for(config, args.block_size, dtype_name, args.order)
    copy_bps = copy_bandwidth(device)
    longest = context + 2 * steps + 16
    num_blocks = batch * blocks_needed(longest, args.block_size)
    caches = private_kv_caches(layout, num_blocks, device)
    for k_cache, v_cache in caches:
        k_cache.normal_()
        v_cache.normal_()
    model = LlamaModel.random(config, seed=0, device=device, dtype=dtype)
    blocks = LocalBlocks(num_blocks)
    engine = DecodeEngine(model, caches, args.block_size, max_batch=batch, max_context=longest)
    gen = torch.Generator().manual_seed(args.seed)
    seqs = [
        Seq(
            request_id=str(i),
            prompt_len=context,
            block_ids=blocks.alloc(blocks_needed(context, args.block_size)),
            output=[int(torch.randint(config.vocab_size, (1,), generator=gen))],
            max_new_tokens=1 << 30,
        )
        for i in range(batch)
    ]

    def step() -> None:
        decode_step(model, caches, seqs, blocks, args.block_size, engine)

    def eager_step() -> None:
        decode_step(model, caches, seqs, blocks, args.block_size)

    for _ in range(3):
        step()  # captures the graph
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = []
    with harness.progress(steps, "decode", args.no_progress) as bar:
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            step()  # ends in .tolist(): the host waits for every step
            samples.append(time.perf_counter_ns() - t0)
            bar.update()
    mean_context = sum(s.num_cached for s in seqs) / len(seqs) - steps / 2  # the timed steps' average
    eager_s = timed(eager_step, device, repeat=5)
    replay_s = None
    if engine.graphs:
        graph = engine.graphs[engine.bucket(batch)]
        replay_s = gpu_timed(graph.replay, repeat=20)  # rewrites one slot per sequence: harmless here

    # attention alone, one layer, over the contexts as they now stand
    k_cache, v_cache = caches[0]
    width = max(len(s.block_ids) for s in seqs)
    tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], dtype=torch.int32)
    tables = tables.to(device)
    lens = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32, device=device)
    max_len = max(s.num_cached for s in seqs)
    q = torch.randn(batch, config.num_attention_heads, config.head_dim, device=device, dtype=dtype)
    attention = {}
    for backend in ("auto", "torch"):
        attention[backend] = timed(
            lambda b=backend: paged_decode_attention(
                q, k_cache, v_cache, tables, lens, config.head_dim**-0.5, max_context_len=max_len, backend=b
            ),
            device,
            repeat=20,
        )
    kv_bytes_layer = 2 * int(lens.sum()) * config.num_key_value_heads * config.head_dim * layout.itemsize
    step_kv_bytes = 2 * mean_context * batch * config.num_key_value_heads * config.head_dim * layout.itemsize
    step_kv_bytes *= config.num_hidden_layers
    w_bytes = weight_bytes(model)
    floor_s = (w_bytes + step_kv_bytes) / copy_bps
    step_s = sum(samples) / len(samples) / 1e9
    if args.profile and device.type == "cuda":
        report.raw["profile"] = profile_step(eager_step)
        print(report.raw["profile"])
    if args.sweep and device.type == "cuda":
        report.raw["sweep"] = sweep_attention(q, k_cache, v_cache, tables, lens)
    report.raw["step_ns"] = samples
    report.results.append({
        "graphs": bool(engine.graphs),
        "step": harness_summary(samples),
        "decode_tokens_per_s": round(batch / step_s, 1),
        "ms_per_step": round(1e3 * step_s, 3),
        "floor_ms": round(1e3 * floor_s, 3),
        "step_over_floor": round(step_s / floor_s, 2),
        "weight_gb": round(w_bytes / 1e9, 3),
        "kv_read_gb": round(step_kv_bytes / 1e9, 3),
        "copy_gb_per_s": round(copy_bps / 1e9, 1),
        "graph_replay_ms": None if replay_s is None else round(1e3 * replay_s, 3),
        "eager_ms_per_step": round(1e3 * eager_s, 3),
        "attention_layer_ms": round(1e3 * attention["auto"], 4),
        "attention_layer_ms_torch_gather": round(1e3 * attention["torch"], 4),
        "attention_kv_read_gb_per_s": round(kv_bytes_layer / attention["auto"] / 1e9, 1),
        "attention_backend": "triton" if device.type == "cuda" else "torch",
    })  # fmt: skip
    row = report.results[0]
    report.targets.append(harness.Target(
        "decode step / bandwidth floor", "<= 1.5x", f"{row['step_over_floor']:.2f}x",
        row["step_over_floor"] <= 1.5 if dev.is_cuda else None,
        f"{row['ms_per_step']:.3f} ms against {row['floor_ms']:.3f} ms" + ("" if dev.is_cuda else "; a GPU's figure"),
    ))  # fmt: skip
    report.print_block("decode", body(report))
    report.save(lambda: plot(report))
    return 0


def harness_summary(samples_ns: list[int]) -> dict[str, float]:
    from kvpool.benchmarks.timings import summarize_ns

    return summarize_ns(samples_ns)


def body(report: harness.Report) -> str:
    c, r = report.config, report.results[0]
    replay = "-" if r["graph_replay_ms"] is None else f"{r['graph_replay_ms']:.3f}"
    rows = [[f"{c['batch']} x {c['context']}", f"{r['ms_per_step']:.3f}", f"{r['floor_ms']:.3f}",
             f"{r['step_over_floor']:.2f}x", replay, f"{r['eager_ms_per_step']:.3f}", f"{r['decode_tokens_per_s']:.0f}",
             f"{r['attention_layer_ms']:.4f} / {r['attention_layer_ms_torch_gather']:.4f}"]]  # fmt: skip
    headers = ["batch x context", "ms/step", "floor ms", "/ floor", "replay ms", "eager ms", "tokens/s",
               "attention ms: kernel / gather"]  # fmt: skip
    head = f"{c['preset']} {c['dtype']}, block size {c['block_size']}, {c['order']}, {c['steps']} steps"
    sweep = report.raw.get("sweep") or []
    tail = "".join(f"\nsweep: {row}" for row in sweep[:12])
    return head + "\n" + harness.table(headers, rows) + tail


def plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    r = report.results[0]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = {"step": r["ms_per_step"], "floor": r["floor_ms"], "eager step": r["eager_ms_per_step"]}
    if r["graph_replay_ms"] is not None:
        bars["graph replay"] = r["graph_replay_ms"]
    ax.bar(list(bars), list(bars.values()))
    ax.set(ylabel="ms", title="one decode step of the batch")
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"kvpool decode ({machine.describe_device(machine.device_info(report.device))})")
    return fig
