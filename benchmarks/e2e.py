"""e2e: open-loop serving through the pool's workers against monolithic workers with private prefix caches.

Requests arrive as a Poisson process at each ``--rates`` value (requests/s) for ``--duration-s``; each is written
to a worker's stdin at its arrival instant whether or not earlier ones are done (open loop). Every side runs
the same model, kernels, batched chunked prefill (``workers/batching.py``) and decode step, in long-lived
processes warmed up before anything is timed:

  pool     ``kvpool serve``, ``kvpool.workers.prefill`` (prefix lookup in the pool, compute the rest into arena blocks,
           commit, hand off) and ``kvpool.workers.decode`` (claims, decodes in a continuous batch)
  mono     ``kvpool.workers.monolithic``: prefill and decode in one process taking turns, a private prefix cache

Scenarios (``--scenarios``):

  1  one GPU: pool (one prefill + one decode worker) vs one monolithic worker
  2  two GPUs: prefill on GPU 0 and decode on GPU 1 through one pool (an arena per GPU; the decode worker's claim
     copies each prompt's KV to GPU 1) vs two monolithic replicas, one per GPU, behind a round-robin front
     (``--push-too`` adds the pool with the prefill copying the KV before its handoff, ``--push-to``)
  3  two prefill workers sharing one pool's prefix cache vs the same two each with a pool of its own (a private
     cache); requests ask for one token, so this measures prefill: hit rate, TTFT, and the memory the cached
     prefix blocks take at the end of each rate (a shared prefix is stored once, not once per worker)
  4  a host tier: one pool with ``--host-blocks`` against the same pool without, both with a small arena
     (``--host-arena-blocks``), on distinct prompts that take ``--host-factor`` x that arena, each sent
     ``--host-passes`` times (the ``revisit`` workload; one token each, so this measures prefill): hit rate, TTFT,
     and the pool's own figures of what it offloaded and restored, with its copy bandwidth

Workloads: ``unique`` (random prompts) and ``mixed`` (``--mix``: prompts opening with one of a few shared system
prompts, turns of multi-turn conversations whose prompt is the previous turn's prompt and answer plus a new
message, and unique ones). Prompt lengths vary +-25% around ``--prompt-len``; output lengths are uniform in
[0.5, 1.5] x ``--max-new-tokens``. Every rate draws new prompts, so no rate hits what an earlier one cached; both
sides of a comparison get the same requests at the same instants.

Measured by the parent, from the instant a request is written: TTFT to the first-token line (the prefill's
line after the handoff, or the monolithic ``first`` event), E2E to the final line, TPOT = (E2E - TTFT) /
(tokens - 1). Goodput: requests per second (over the arrival span) that met both ``--slo-ttft-ms`` and
``--slo-tpot-ms``. Output tokens/s: tokens over the span from the first arrival to the last completion.

Model: on CPU the workers' tiny random model; on GPU a random model shaped like a 1B Llama (``--model-preset``),
or any local checkpoint with ``--model``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.benchmarks.e2e_report import body, plot, targets
from kvpool.benchmarks.e2e_report import rates as report_rates
from kvpool.benchmarks.e2e_sides import Env, Side, drive, mono_side, pool_side, summarize
from kvpool.benchmarks.e2e_workload import WORKLOADS, make_revisits, make_workload

PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's shape (random weights): 16 layers, GQA 32/8, head dim 64.
    "1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=None, help="comma list of 1, 2, 3 [1,3; 2 needs two GPUs]")
    parser.add_argument("--rates", type=harness_floats, default=None, help="arrival rates, requests/s [GPU 8,16,32,64]")
    parser.add_argument(
        "--prefill-rates", type=harness_floats, default=None, help="scenario 3's rates [GPU 32,96,192; else --rates]"
    )
    parser.add_argument("--duration-s", type=float, default=None, help="arrivals per rate last this long [GPU 8]")
    parser.add_argument("--min-requests", type=int, default=None, help="at least this many requests per rate [GPU 24]")
    parser.add_argument("--prompt-len", type=int, default=None, help="mean prompt tokens [CPU 128, GPU 1024]")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="mean output tokens [CPU 8, GPU 64]")
    parser.add_argument(
        "--mix", default="shared=0.7,multiturn=0.25,unique=0.05", help="the mixed workload's request classes"
    )
    parser.add_argument("--system-frac", type=float, default=0.85, help="share of a shared prompt that is the system's")
    parser.add_argument("--num-systems", type=int, default=4, help="distinct system prompts per rate")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput's TTFT bound [CPU 3000, GPU 300]")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput's TPOT bound [CPU 500, GPU 30]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=64, help="sequences decoded together (every side)")
    parser.add_argument("--token-budget", type=int, default=4096, help="prompt tokens per prefill forward")
    parser.add_argument("--cache-blocks", type=int, default=None, help="KV blocks per pool or private cache")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, default=None, help="local Hugging Face-format checkpoint")
    which.add_argument(
        "--model-preset", choices=["tiny", *PRESETS], default=None, help="random model [CPU tiny, GPU 1b]"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default=None, help="[CPU float32, GPU bfloat16]"
    )
    parser.add_argument(
        "--push-too",
        action="store_true",
        help="scenario 2: also run the pool with the prefill copying the KV to GPU 1 (--push-to) (pool-2gpu-push)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="longest one rate may take to drain")
    parser.add_argument("--host-arena-blocks", type=int, default=None, help="scenario 4's arena [CPU 128, GPU 1024]")
    parser.add_argument("--host-factor", type=float, default=5.0, help="scenario 4's distinct prompts / arena [5]")
    parser.add_argument("--host-passes", type=int, default=3, help="times scenario 4 sends each prompt [3]")
    parser.add_argument("--host-rates", type=harness_floats, default=None, help="scenario 4's rates [CPU 4, GPU 32]")


def harness_floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


# -- the run ------------------------------------------------------------------------------------------------------


def _model(args: argparse.Namespace, device: machine.Device, dtype: str, workdir: Path) -> tuple[Any, list[str], str]:
    """The model config, the workers' model flags, and a name for the pool's prefix namespace."""
    from kvpool.workers.cli import TINY
    from kvpool.workers.model import LlamaConfig

    if args.model is not None:
        return LlamaConfig.from_dir(args.model), ["--model", str(args.model), "--dtype", dtype], args.model.name
    preset = args.model_preset or ("1b" if device.is_cuda else "tiny")
    seed = ["--random-model", "--seed", str(args.seed), "--dtype", dtype]
    if preset == "tiny":
        return TINY, seed, f"random-tiny-{args.seed}"
    config = LlamaConfig.from_dict(PRESETS[preset])
    path = workdir / f"{preset}.json"
    path.write_text(json.dumps(config.to_dict()))
    return config, [*seed, "--model-config", str(path)], f"random-{preset}-{args.seed}"


def _config(args: argparse.Namespace, device: machine.Device) -> dict[str, Any]:
    gpu, quick = device.is_cuda, args.quick
    scenarios = args.scenarios or "1,3"
    return {
        "scenarios": [s.strip() for s in scenarios.split(",") if s.strip()],
        "rates": args.rates or ([4.0] if quick else [8.0, 16.0, 32.0, 64.0] if gpu else [1.0, 2.0]),
        "prefill_rates": args.prefill_rates
        or args.rates
        or ([4.0] if quick else [32.0, 96.0, 192.0] if gpu else [2.0, 4.0]),
        "duration_s": args.duration_s if args.duration_s is not None else (1.0 if quick else 8.0 if gpu else 6.0),
        "min_requests": args.min_requests or (4 if quick else 24 if gpu else 8),
        "prompt_len": args.prompt_len or (48 if quick else 1024 if gpu else 128),
        "max_new_tokens": args.max_new_tokens or (4 if quick else 64 if gpu else 8),
        "mix": args.mix,
        "system_frac": args.system_frac,
        "num_systems": args.num_systems,
        "slo_ttft_ms": args.slo_ttft_ms or (300.0 if gpu else 3000.0),
        "slo_tpot_ms": args.slo_tpot_ms or (30.0 if gpu else 500.0),
        "block_size": args.block_size,
        "max_batch": args.max_batch,
        "token_budget": args.token_budget,
        "cache_blocks": args.cache_blocks or (16384 if gpu else 2048),
        "warmup_requests": 8,
        "push_too": args.push_too,
        "host_arena_blocks": args.host_arena_blocks or (1024 if gpu else 48 if quick else 128),
        "host_factor": args.host_factor,
        "host_passes": args.host_passes,
        "host_rates": args.host_rates or ([32.0] if gpu else [4.0]),
    }


def run(args: argparse.Namespace) -> int:
    device = machine.resolve_device(args)
    try:
        from kvpool.workers.kvcache import layout_for
    except ImportError as exc:
        raise SystemExit(f"e2e: the workers are not usable here ({exc}): this suite needs workers/") from exc
    cfg = _config(args, device)
    if "2" in cfg["scenarios"]:
        import torch

        if not device.is_cuda or torch.cuda.device_count() < 2:
            raise SystemExit("e2e: scenario 2 needs two GPUs (prefill on one, decode on the other); drop it")
    dtype = args.dtype or ("bfloat16" if device.is_cuda else "float32")
    with tempfile.TemporaryDirectory(prefix="kvb-e2e-") as tmp:
        workdir = Path(tmp)
        config, model_args, name = _model(args, device, dtype, workdir)
        layout = layout_for(config, args.block_size, dtype)
        cfg |= {"model": name, "model_config": config.to_dict(), "layout": layout.model_dump(), "dtype": dtype}
        # On CPU the processes split the cores; on a GPU each takes torch's default.
        env = Env(device, workdir, layout, model_args, name, 0 if device.is_cuda else 1, cfg)
        report = harness.Report("e2e", args, device, cfg)
        for scenario in cfg["scenarios"]:
            _scenario(report, env, scenario, config.vocab_size)
    targets(report)
    report.print_block("e2e", body(report))
    report.save(plot(report))
    return 0


@contextlib.contextmanager
def _sides(env: Env, scenario: str) -> Iterator[dict[str, Side]]:
    made: dict[str, Side] = {}
    gpu = env.device.torch_device
    try:
        if scenario == "1":
            made["pool"] = pool_side(env, "pool", 1, 1, None)
            made["mono"] = mono_side(env, "mono", [gpu])
        elif scenario == "2":
            made["pool-2gpu"] = pool_side(env, "pool-2gpu", 1, 1, (0, 1))
            if env.cfg["push_too"]:
                made["pool-2gpu-push"] = pool_side(env, "pool-2gpu-push", 1, 1, (0, 1), push=True)
            made["mono-x2"] = mono_side(env, "mono-x2", ["cuda:0", "cuda:1"])
        elif scenario == "3":
            made["shared-2p"] = pool_side(env, "shared-2p", 1, 2, None)
            made["private-2p"] = pool_side(env, "private-2p", 2, 1, None)
        elif scenario == "4":
            arena = env.cfg["host_arena_blocks"]
            host = math.ceil((env.cfg["host_factor"] + 1) * arena)  # every distinct prompt, and room to spare
            made["pool-host"] = pool_side(env, "pool-host", 1, 1, None, num_blocks=arena, host_blocks=host)
            made["pool-nohost"] = pool_side(env, "pool-nohost", 1, 1, None, num_blocks=arena)
        else:
            raise SystemExit(f"e2e: no scenario {scenario!r} (1, 2, 3 or 4)")
        yield made
    finally:
        for side in made.values():
            side.stop()


def _scenario(report: harness.Report, env: Env, scenario: str, vocab: int) -> None:
    cfg, args = env.cfg, report.args
    one_token = scenario in ("3", "4")
    rates = report_rates(cfg, scenario)
    workloads = ("revisit",) if scenario == "4" else WORKLOADS
    with _sides(env, scenario) as sides:
        warmup = {**cfg, "duration_s": 0, "min_requests": cfg["warmup_requests"]}
        warm = make_workload("unique", 1000.0, warmup, vocab, -1)
        for side in sides.values():
            for r in warm:
                r.request_id = f"warm-{side.name}-{r.request_id}"
            drive(side, warm, args.timeout_s)
        steps = len(rates) * len(workloads) * len(sides)
        with harness.progress(steps, f"e2e scenario {scenario}", args.no_progress) as bar:
            for k, rate in enumerate(rates):
                for workload in timings.rotated(workloads, k):
                    seed = args.seed * 10 + int(scenario)
                    if workload == "revisit":
                        requests = make_revisits(rate, cfg, vocab, seed)
                    else:
                        requests = make_workload(workload, rate, cfg, vocab, seed)
                    if one_token:
                        for r in requests:
                            r.max_new_tokens = 1
                    tokens = {}
                    for name in timings.rotated(list(sides), k):
                        side = sides[name]
                        before = side.prefix_bytes()
                        got = drive(side, requests, args.timeout_s)
                        stats, raw = summarize(requests, got, cfg["slo_ttft_ms"], cfg["slo_tpot_ms"], cfg["duration_s"])
                        stats |= {"scenario": scenario, "side": name, "workload": workload, "rate": rate}
                        if side.pools:
                            stats["prefix_bytes_stored"] = side.prefix_bytes() - before
                            stats["tiers"] = side.pools[0].stats()["tiers"]  # cumulative, warm-up included
                        report.results.append(stats)
                        report.raw[f"{scenario}/{name}/{workload}/{rate:g}"] = raw
                        tokens[name] = [got[r.request_id]["tokens"] for r in requests]
                        bar.update()
                    first, *others = tokens.values()
                    bad = sum(any(o[i] != x for o in others) for i, x in enumerate(first))
                    if bad:
                        report.notes.append(
                            f"scenario {scenario}, {workload} at {rate:g}/s: {bad} of {len(first)} requests' tokens "
                            "differ between sides"
                        )
