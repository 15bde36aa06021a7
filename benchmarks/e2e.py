"""e2e: prefill and decode workers through the pool, against one monolithic worker, with and without shared prefixes.

Both sides run the same model, kernels and greedy decode step (``workers/``), each in its own long-lived
processes, warmed up with one batch before anything is timed:

  pool   a real pool and the prefill and decode workers (``kvpool worker``, as deployed): the prefill looks the
         prompt up in the prefix cache, computes the rest into arena blocks, commits and hands off; the decode
         claims and decodes in batches. The prompts are written to the prefill's stdin at t0; a request's first
         token exists when the prefill prints its line (after the handoff), its last when the decode prints its
         own (lines are time-stamped as they arrive, on CLOCK_MONOTONIC)
  mono   one process running the loop of ``kvpool.workers.monolithic.greedy_generate`` (prefill each prompt from
         scratch into a private paged cache, then decode the batch), time-stamped the same way

Workloads: ``unique`` (random prompts) and ``shared`` (every prompt starts with the same prefix, ``--shared-frac``
of its length, new each round). Each round runs both workloads on both sides, in a rotating order. Reported:
output tokens/s over the batch's wall time (all requests arrive at t0), TTFT (t0 to first token), TPOT ((last -
first token) / (tokens - 1)), end-to-end latency, prefix-cache hits; and whether both sides produced the same
tokens.

Model: on CPU the workers' tiny random model (``kvpool.workers.cli.TINY``); on GPU a random model shaped like a 1B Llama
(``--model-preset``), or any local checkpoint with ``--model``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from kvpool.benchmarks import harness

MODES = ("pool", "mono")
WORKLOADS = ("unique", "shared")
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
    parser.add_argument("--requests", type=int, default=None, help="requests per batch [CPU 8, GPU 32]")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt [CPU 256, GPU 1024]")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens generated per request [CPU 16, GPU 64]"
    )
    parser.add_argument("--shared-frac", type=float, default=0.75, help="share of a prompt that is the shared prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (both sides)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, default=None, help="local Hugging Face-format checkpoint")
    which.add_argument(
        "--model-preset", choices=["tiny", *PRESETS], default=None, help="random model [CPU tiny, GPU 1b]"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="KV and compute dtype [CPU float32, GPU bfloat16]",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest a batch may take")


# -- the monolithic process ---------------------------------------------------------------------------------------


def _mono_main(argv: list[str]) -> None:
    """``python -m kvpool.benchmarks.e2e LAYOUT_JSON DEVICE THREADS MODEL_ARGS...``: batches in on stdin, timings out.

    Each stdin line is ``{"prompts", "max_new_tokens", "max_batch"}``; each reply line has the batch's start and,
    per prompt, the first-token and last-token instants (perf_counter_ns) and the tokens.
    """
    import torch
    from kvpool.workers.cli import add_model_arguments, load_model

    from kvpool.layout import KVLayout

    layout = KVLayout.model_validate_json(argv[0])
    device, threads = torch.device(argv[1]), int(argv[2])
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    model = load_model(parser.parse_args(argv[3:]), layout, device)
    if threads:
        torch.set_num_threads(threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        t0 = time.perf_counter_ns()
        first, done, tokens = _timed_generate(model, spec["prompts"], spec["max_new_tokens"], layout, spec["max_batch"])
        print(json.dumps({"t0": t0, "first": first, "done": done, "tokens": tokens}), flush=True)


def _timed_generate(
    model: Any, prompts: list[list[int]], max_new_tokens: int, layout: Any, max_batch: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """``greedy_generate``'s loop (:mod:`kvpool.workers.monolithic`), step for step, with the instant each request's
    first and last token exist (the greedy ``.tolist()`` waits for the device, so the instants are real)."""
    from kvpool.workers.kvcache import private_kv_caches
    from kvpool.workers.monolithic import LocalBlocks
    from kvpool.workers.sequence import Sequence, blocks_needed, decode_step, greedy

    bs, clock = layout.block_size, time.perf_counter_ns
    total = sum(blocks_needed(len(p) + max_new_tokens, bs) for p in prompts)
    caches = private_kv_caches(layout, total, model.device)
    blocks = LocalBlocks(total)
    first, done = [0] * len(prompts), [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(prompts), max_batch):
        seqs = []
        for i, prompt in enumerate(prompts[start : start + max_batch], start):
            table = blocks.alloc(blocks_needed(len(prompt), bs))
            logits = model.prefill(prompt, table, 0, caches)
            seqs.append(Sequence(str(i), len(prompt), table, greedy(logits[None])[:1], max_new_tokens))
            first[i] = clock()
        active = [s for s in seqs if not s.done]
        for s in seqs:
            if s.done:
                done[int(s.request_id)] = first[int(s.request_id)]
        while active:
            decode_step(model, caches, active, blocks, bs)
            now = clock()
            for s in active:
                if s.done:
                    done[int(s.request_id)] = now
                    blocks.free(s.block_ids)
            active = [s for s in active if not s.done]
        for s in seqs:
            outputs[int(s.request_id)] = s.output
    return first, done, outputs


# -- the parent's handles on the processes ------------------------------------------------------------------------


class _Lines:
    """Reads a child's stdout in a thread, time-stamping each JSON line as it arrives."""

    def __init__(self, name: str, stream: IO[str], sink: queue.Queue[tuple[str, int, dict[str, Any] | None]]) -> None:
        def pump() -> None:
            for line in stream:
                if line.strip():
                    sink.put((name, time.perf_counter_ns(), json.loads(line)))
            sink.put((name, time.perf_counter_ns(), None))

        threading.Thread(target=pump, name=f"e2e-{name}", daemon=True).start()


def _spawn(cmd: list[str], log: Path, stdin: bool = True) -> subprocess.Popen[str]:
    with log.open("w") as err:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
            env=harness.child_env(),
            cwd=harness.ROOT,
        )


class _Side:
    """A side of the comparison: its processes, and one batch of requests at a time through them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.lines: queue.Queue[tuple[str, int, dict[str, Any] | None]] = queue.Queue()
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def _next(self, deadline: float) -> tuple[str, int, dict[str, Any]]:
        left = deadline - time.monotonic()
        try:
            name, at, record = self.lines.get(timeout=max(0.01, left))
        except queue.Empty:
            raise RuntimeError(f"no answer within the timeout{self._logs()}") from None
        if record is None:
            raise RuntimeError(f"the {name} process exited{self._logs()}")
        if record.get("error"):
            raise RuntimeError(f"the {name} process failed a request: {record}{self._logs()}")
        return name, at, record

    def _logs(self) -> str:
        out = []
        for name in self.procs:
            log = self.workdir / f"{name}.log"
            if log.exists():
                out.append(f"\n--- {name} log ---\n{log.read_text(errors='replace')[-3000:]}")
        return "".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _Pool(_Side):
    """A prefill and a decode worker on a real pool."""

    def __init__(self, workdir: Path, url: str, model_args: list[str], threads: int, max_batch: int) -> None:
        super().__init__(workdir)
        base = ["--pool", url, "--threads", str(threads), *model_args]
        py = [sys.executable, "-m"]
        decode = ["--name", "e2e-decode", "--max-batch", str(max_batch), "--idle-wait-s", "0.05"]
        decode_cmd = [*py, "kvpool.workers.decode", *base, *decode]
        self.procs["decode"] = _spawn(decode_cmd, workdir / "decode.log", stdin=False)
        prefill = [*py, "kvpool.workers.prefill", *base, "--handoff-to", "e2e-decode"]
        self.procs["prefill"] = _spawn(prefill, workdir / "prefill.log")
        for name, proc in self.procs.items():
            assert proc.stdout is not None
            _Lines(name, proc.stdout, self.lines)

    def run(self, prompts: list[list[int]], max_new_tokens: int, timeout_s: float) -> dict[str, Any]:
        tag = os.urandom(4).hex()
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        body = "".join(
            json.dumps({"request_id": rid, "prompt": p, "max_new_tokens": max_new_tokens}) + "\n"
            for rid, p in zip(ids, prompts, strict=True)
        )
        stdin = self.procs["prefill"].stdin
        assert stdin is not None
        t0 = time.perf_counter_ns()
        stdin.write(body)
        stdin.flush()
        first: dict[str, int] = {}
        done: dict[str, tuple[int, dict[str, Any]]] = {}
        hits: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ids) or len(first) < len(ids):
            name, at, record = self._next(deadline)
            if name == "prefill":
                first[record["request_id"]] = at
                hits[record["request_id"]] = record.get("hit_tokens", 0)
            else:
                done[record["request_id"]] = (at, record)
        return {
            "t0": t0,
            "first": [first[r] for r in ids],
            "done": [done[r][0] for r in ids],
            "tokens": [done[r][1]["tokens"] for r in ids],
            "hit_tokens": sum(hits.values()),
        }


class _Mono(_Side):
    """The monolithic process."""

    def __init__(
        self, workdir: Path, layout: Any, device: str, model_args: list[str], threads: int, max_batch: int
    ) -> None:
        super().__init__(workdir)
        self.max_batch = max_batch
        cmd = [sys.executable, "-m", __name__, layout.model_dump_json(), device, str(threads), *model_args]
        proc = self.procs["mono"] = _spawn(cmd, workdir / "mono.log")
        assert proc.stdout is not None
        _Lines("mono", proc.stdout, self.lines)
        self._next(time.monotonic() + 600)  # {"ready": true} once the model is loaded

    def run(self, prompts: list[list[int]], max_new_tokens: int, timeout_s: float) -> dict[str, Any]:
        stdin = self.procs["mono"].stdin
        assert stdin is not None
        stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens, "max_batch": self.max_batch}))
        stdin.write("\n")
        stdin.flush()
        _, _, record = self._next(time.monotonic() + timeout_s)
        return {**record, "hit_tokens": 0}


# -- the run ------------------------------------------------------------------------------------------------------


def _model(args: argparse.Namespace, device: harness.Device, dtype: str, workdir: Path) -> tuple[Any, list[str], str]:
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


def _prompts(workload: str, n: int, length: int, shared_frac: float, vocab: int, rng: random.Random) -> list[list[int]]:
    def toks(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    if workload == "unique":
        return [toks(length) for _ in range(n)]
    prefix = toks(int(length * shared_frac))
    return [prefix + toks(length - len(prefix)) for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    device = harness.resolve_device(args)
    try:
        from kvpool.workers.kvcache import layout_for
        from kvpool.workers.sequence import blocks_needed
    except ImportError as exc:
        raise SystemExit(
            f"e2e: the workers are not usable here ({exc}): this suite needs workers/ (prefill, decode, "
            "model, monolithic)"
        ) from exc
    quick = args.quick
    n = args.requests or (3 if quick else 32 if device.is_cuda else 8)
    length = args.prompt_len or (48 if quick else 1024 if device.is_cuda else 256)
    gen = args.max_new_tokens or (4 if quick else 64 if device.is_cuda else 16)
    dtype = args.dtype or ("bfloat16" if device.is_cuda else "float32")
    with tempfile.TemporaryDirectory(prefix="kvb-e2e-") as tmp:
        workdir = Path(tmp)
        config, model_args, name = _model(args, device, dtype, workdir)
        layout = layout_for(config, args.block_size, dtype)
        report = harness.Report(
            "e2e",
            args,
            device,
            {
                "requests": n,
                "prompt_len": length,
                "max_new_tokens": gen,
                "shared_frac": args.shared_frac,
                "rounds": args.rounds or (1 if quick else 3),
                "warmup_batches": 1,
                "block_size": args.block_size,
                "max_batch": args.max_batch,
                "model": name,
                "model_config": config.to_dict(),
                "layout": layout.model_dump(),
                "pool_blocks": 2 * n * blocks_needed(length + gen, args.block_size) + 64,
                # On CPU the two workers split the cores, and the monolithic process gets them all.
                "threads_per_worker": None if device.is_cuda else max(1, (os.cpu_count() or 2) // 2),
                "modes": MODES,
                "workloads": WORKLOADS,
            },
        )
        _measure(report, workdir, model_args, config.vocab_size, layout)
    report.print_block("e2e", _body(report))
    report.save(lambda: _plot(report))
    return 0


def _measure(report: harness.Report, workdir: Path, model_args: list[str], vocab: int, layout: Any) -> None:
    """Both sides on the same prompts, workload by workload and round by round, in rotating orders."""
    args, cfg = report.args, report.config
    n, length, gen, rounds = cfg["requests"], cfg["prompt_len"], cfg["max_new_tokens"], cfg["rounds"]
    threads = cfg["threads_per_worker"] or 0
    rng = random.Random(args.seed)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    mismatches: list[str] = []

    pool_flags = [*harness.layout_flags(layout), "--num-blocks", str(cfg["pool_blocks"]), "--model", cfg["model"]]
    with harness.start_pool(report.device, *pool_flags) as pool:
        sides: dict[str, Any] = {}
        try:
            sides["pool"] = _Pool(workdir, pool.url, model_args, threads, args.max_batch)
            sides["mono"] = _Mono(workdir, layout, report.device.torch_device, model_args, 2 * threads, args.max_batch)
            warm = _prompts("unique", n, length, 0, vocab, rng)  # the batch's shapes, before timing
            for side in sides.values():
                side.run(warm, gen, args.timeout_s)
            with harness.progress(rounds * len(WORKLOADS) * len(MODES), "e2e", args.no_progress) as bar:
                for r in range(rounds):
                    for workload in harness.rotated(WORKLOADS, r):
                        prompts = _prompts(workload, n, length, args.shared_frac, vocab, rng)
                        got = {}
                        for mode in harness.rotated(MODES, r):
                            got[mode] = sides[mode].run(prompts, gen, args.timeout_s)
                            runs.setdefault((workload, mode), []).append(got[mode])
                            bar.update()
                        bad = sum(a != b for a, b in zip(got["pool"]["tokens"], got["mono"]["tokens"], strict=True))
                        if bad:
                            mismatches.append(f"round {r}, {workload}: {bad} of {n} requests' tokens differ")
        finally:
            for side in sides.values():
                side.stop()
    _summarize(report, runs, n, length, mismatches)


def _summarize(
    report: harness.Report,
    runs: dict[tuple[str, str], list[dict[str, Any]]],
    n: int,
    length: int,
    mismatches: list[str],
) -> None:
    for (workload, mode), batches in runs.items():
        ttft, tpot, e2e, tokens, wall = [], [], [], 0, 0
        for b in batches:
            for f, d, toks in zip(b["first"], b["done"], b["tokens"], strict=True):
                ttft.append(f - b["t0"])
                e2e.append(d - b["t0"])
                if len(toks) > 1:
                    tpot.append((d - f) // (len(toks) - 1))
                tokens += len(toks)
            wall += max(b["done"]) - b["t0"]
        stats = {f"ttft_{k}": v for k, v in harness.summarize_ns(ttft).items() if k != "n"}
        stats |= {f"tpot_{k}": v for k, v in harness.summarize_ns(tpot).items() if k != "n"}
        stats |= {f"e2e_{k}": v for k, v in harness.summarize_ns(e2e).items() if k != "n"}
        hit = sum(b["hit_tokens"] for b in batches)
        report.results.append(
            {
                "workload": workload,
                "mode": mode,
                "batches": len(batches),
                "requests": n * len(batches),
                "output_tokens": tokens,
                "output_tokens_per_s": tokens / wall * 1e9,
                "prompt_tokens_per_s": n * length * len(batches) / wall * 1e9,
                "hit_tokens": hit,
                "hit_rate": hit / (n * length * len(batches)),
                **stats,
            }
        )
        report.raw[f"{workload}/{mode}"] = {"ttft_ns": ttft, "tpot_ns": tpot, "e2e_ns": e2e}
    report.notes.extend(mismatches)
    report.targets.append(
        harness.Target(
            "pool and monolithic produce the same tokens",
            "identical",
            "identical" if not mismatches else "DIFFERENT",
            not mismatches,
            "; ".join(mismatches),
        )
    )


def _body(report: harness.Report) -> str:
    rows = {(r["workload"], r["mode"]): r for r in report.results}
    body = []
    for w in WORKLOADS:
        for m in MODES:
            r = rows[w, m]
            body.append(
                [
                    w,
                    m,
                    f"{r['output_tokens_per_s']:.1f}",
                    f"{harness.fmt_us(r['ttft_p50_us'])}",
                    f"{harness.fmt_us(r['ttft_p99_us'])}",
                    f"{harness.fmt_us(r['tpot_p50_us'])}",
                    f"{harness.fmt_us(r['tpot_p99_us'])}",
                    f"{harness.fmt_us(r['e2e_p50_us'])}",
                    f"{r['hit_rate']:.0%}",
                ]
            )
    cfg = report.config
    head = ["workload", "side", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "hits"]
    ratio = [
        [
            w,
            f"{rows[w, 'pool']['output_tokens_per_s'] / rows[w, 'mono']['output_tokens_per_s']:.2f}x",
            f"{rows[w, 'mono']['ttft_p50_us'] / rows[w, 'pool']['ttft_p50_us']:.2f}x",
            f"{rows[w, 'mono']['tpot_p50_us'] / rows[w, 'pool']['tpot_p50_us']:.2f}x",
        ]
        for w in WORKLOADS
    ]
    return (
        f"{cfg['requests']} requests x {cfg['prompt_len']} prompt tokens -> {cfg['max_new_tokens']} new tokens, "
        f"{cfg['model']}, {cfg['rounds']} round(s):\n"
        + harness.table(head, body)
        + "\n\nPool against mono (above 1x: the pool is better):\n"
        + harness.table(["workload", "tokens/s", "TTFT p50", "TPOT p50"], ratio)
    )


def _plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    rows = {(r["workload"], r["mode"]): r for r in report.results}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.38
    for i, m in enumerate(MODES):
        xs = [j + i * width for j in range(len(WORKLOADS))]
        axes[0].bar(xs, [rows[w, m]["output_tokens_per_s"] for w in WORKLOADS], width, label=m)
        axes[1].bar(xs, [rows[w, m]["ttft_p50_us"] / 1e3 for w in WORKLOADS], width, label=m)
        axes[2].bar(xs, [rows[w, m]["tpot_p50_us"] / 1e3 for w in WORKLOADS], width, label=m)
    for ax, title, unit in zip(
        axes, ("output tokens/s", "TTFT p50", "TPOT p50"), ("tokens/s", "ms", "ms"), strict=True
    ):
        ax.set_xticks([j + width / 2 for j in range(len(WORKLOADS))], WORKLOADS)
        ax.set(title=title, ylabel=unit)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"kvpool e2e, {report.config['model']} ({harness.describe_device(harness.device_info(report.device))})"
    )
    return fig


if __name__ == "__main__":
    _mono_main(sys.argv[1:])
