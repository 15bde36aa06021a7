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
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvpool.benchmarks import harness, machine, timings

WORKLOADS = ("unique", "mixed")
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
#: (scenario, the side kvpool wins with, its baseline)
SIDES = {"1": ("pool", "mono"), "2": ("pool-2gpu", "mono-x2"), "3": ("shared-2p", "private-2p")}


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


def harness_floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


# -- the workload -------------------------------------------------------------------------------------------------


@dataclass
class Request:
    at_s: float
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    kind: str

    def line(self) -> str:
        return json.dumps({"request_id": self.request_id, "prompt": self.prompt, "max_new_tokens": self.max_new_tokens})


def make_workload(workload: str, rate: float, cfg: dict[str, Any], vocab: int, seed: int) -> list[Request]:
    """Poisson arrivals over the duration (at least ``min_requests``), prompts and output lengths drawn.

    The arrival instants, output lengths and length jitters depend on ``seed`` and the rate only, so both
    workloads at one rate offer the same load; the tokens differ with the workload.
    """
    n_min, length, gen = cfg["min_requests"], cfg["prompt_len"], cfg["max_new_tokens"]
    timing = random.Random(f"{seed}-{rate}")
    rng = random.Random(f"{seed}-{rate}-{workload}")
    times, t = [], 0.0
    while t < cfg["duration_s"] or len(times) < n_min:
        times.append(t)
        t += timing.expovariate(rate)

    def toks(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, k))]

    jitters = [timing.uniform(0.75, 1.25) for _ in times]
    news = [max(1, int(gen * timing.uniform(0.5, 1.5))) for _ in times]

    mix = {k: float(v) for k, v in (part.split("=") for part in cfg["mix"].split(","))}
    classes, weights = list(mix), list(mix.values())
    systems = [toks(int(length * cfg["system_frac"])) for _ in range(cfg["num_systems"])]
    conversations: list[list[int]] = [[] for _ in range(max(1, cfg["num_systems"] * 2))]
    out = []
    for i, at in enumerate(times):
        kind = "unique" if workload == "unique" else rng.choices(classes, weights)[0]
        new, full = news[i], max(1, int(length * jitters[i]))
        if kind == "shared":
            system = rng.choice(systems)
            prompt = system + toks(full - len(system))
        elif kind == "multiturn":
            c = rng.randrange(len(conversations))
            history = conversations[c]
            if len(history) > 3 * length:
                history = []  # a conversation that outgrew its window starts over
            prompt = history + toks(length // 4 if history else full)
            conversations[c] = prompt + toks(new)  # the next turn carries this answer (as tokens of its own)
        else:
            prompt = toks(full)
        out.append(Request(at, f"{workload}-{rate:g}-{i}", prompt, new, kind))
    return out


# -- processes ------------------------------------------------------------------------------------------------------


Line = tuple[str, int, dict[str, Any] | None]


def _spawn(cmd: list[str], log: Path, lines: queue.Queue[Line], name: str, stdin: bool) -> subprocess.Popen[str]:
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
            env=harness.child_env(),
            cwd=harness.ROOT,
        )

    def pump(stream: IO[str]) -> None:
        for line in stream:
            if line.strip():
                lines.put((name, time.perf_counter_ns(), json.loads(line)))
        lines.put((name, time.perf_counter_ns(), None))

    assert proc.stdout is not None
    threading.Thread(target=pump, args=(proc.stdout,), name=f"e2e-{name}", daemon=True).start()
    return proc


class Side:
    """Processes that take requests on the stdins of ``front`` (round-robin) and print first/final lines."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lines: queue.Queue[Line] = queue.Queue()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.front: list[str] = []
        self.pools: list[harness.Server] = []
        self.block_nbytes = 0
        self._next_front = 0

    def spawn(self, name: str, cmd: list[str], front: bool) -> None:
        self.procs[name] = _spawn(cmd, self.workdir / f"{name}.log", self.lines, name, stdin=front)
        if front:
            self.front.append(name)

    def send(self, req: Request) -> None:
        name = self.front[self._next_front % len(self.front)]
        self._next_front += 1
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(req.line() + "\n")
        stdin.flush()

    def event(self, name: str, record: dict[str, Any]) -> tuple[str, str] | None:
        """``("first" | "done", request_id)`` for a line, or None for lines that are neither."""
        if record.get("ready"):
            return None
        if record.get("error"):
            raise RuntimeError(f"{self.name}/{name} failed a request: {record}{self.logs()}")
        if name.startswith("prefill"):
            return "first", record["request_id"]
        if name.startswith("mono") and record.get("event") == "first":
            return "first", record["request_id"]
        return "done", record["request_id"]

    def prefix_bytes(self) -> int:
        """Bytes of the prefix blocks the side's pools have stored so far (committed as new: a prompt's blocks
        that an identical prefix committed before are not stored again); 0 for caches we cannot see."""
        from kvpool.client import http_client

        total = 0
        for pool in self.pools:
            with http_client(pool.url, None, 5.0) as http:
                stats = http.get("/stats").json()
            total += stats["counters"]["committed_blocks"] * self.block_nbytes
        return total

    def logs(self) -> str:
        out = []
        for log in sorted(self.workdir.glob("*.log")):
            out.append(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
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
        for pool in self.pools:
            pool.stop()


@dataclass
class Env:
    """What every side is built from."""

    device: machine.Device
    workdir: Path
    layout: Any
    model_args: list[str]
    model_name: str
    threads: int
    cfg: dict[str, Any]

    def worker_flags(self) -> list[str]:
        return ["--threads", str(self.threads), *self.model_args] if self.threads else list(self.model_args)


def _pool_side(
    env: Env, name: str, units: int, prefills_per_unit: int, devices: tuple[int, int] | None, push: bool = False
) -> Side:
    """``units`` pools, each with ``prefills_per_unit`` prefill workers and one decode worker."""
    side = Side(name, env.workdir)
    side.block_nbytes = env.layout.block_nbytes
    py = [sys.executable, "-m"]
    cfg = env.cfg
    for u in range(units):
        flags = [*harness.layout_flags(env.layout), "--num-blocks", str(cfg["cache_blocks"]), "--model", env.model_name]
        if devices is not None:
            flags += ["--devices", f"{devices[0]},{devices[1]}"]
        pool = harness.start_pool(env.device, *flags)
        side.pools.append(pool)
        decode_name = f"{name}-decode-{u}"
        place_p = ["--device", str(devices[0])] if devices else []
        if devices and push:
            place_p += ["--push-to", str(devices[1])]
        place_d = ["--device", str(devices[1])] if devices else []
        base = ["--pool", pool.url, *env.worker_flags()]
        side.spawn(
            f"decode-{u}",
            [*py, "kvpool.workers.decode", *base, *place_d, "--name", decode_name, "--max-batch", str(cfg["max_batch"]),
             "--idle-wait-s", "0.02"],
            front=False,
        )  # fmt: skip
        for p in range(prefills_per_unit):
            side.spawn(
                f"prefill-{u}-{p}",
                [*py, "kvpool.workers.prefill", *base, *place_p, "--name", f"{name}-prefill-{u}-{p}", "--handoff-to",
                 decode_name, "--token-budget", str(cfg["token_budget"])],
                front=True,
            )  # fmt: skip
    return side


def _mono_side(env: Env, name: str, devices: list[str]) -> Side:
    side = Side(name, env.workdir)
    cfg = env.cfg
    for i, dev in enumerate(devices):
        side.spawn(
            f"mono-{i}",
            [sys.executable, "-m", "kvpool.workers.monolithic", *env.worker_flags(), "--device", dev,
             "--num-blocks", str(cfg["cache_blocks"]), "--block-size", str(env.layout.block_size),
             "--kv-dtype", env.layout.dtype, "--max-batch", str(cfg["max_batch"]),
             "--token-budget", str(cfg["token_budget"])],
            front=True,
        )  # fmt: skip
    return side


def drive(side: Side, requests: list[Request], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Send each request at its instant, collect its first and final lines; per request: the instants (ns)."""
    got: dict[str, dict[str, Any]] = {r.request_id: {} for r in requests}
    pending = {r.request_id for r in requests}
    t0 = time.perf_counter_ns()
    deadline = time.monotonic() + max(r.at_s for r in requests) + timeout_s
    i = 0
    while pending:
        now = time.perf_counter_ns()
        while i < len(requests) and now >= t0 + int(requests[i].at_s * 1e9):
            got[requests[i].request_id]["sent"] = time.perf_counter_ns()
            side.send(requests[i])
            i += 1
        wait = (t0 + int(requests[i].at_s * 1e9) - now) / 1e9 if i < len(requests) else 0.05
        try:
            name, at, record = side.lines.get(timeout=max(0.0, min(wait, 0.05)))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side.name}: {len(pending)} requests unanswered{side.logs()}") from None
            continue
        if record is None:
            raise RuntimeError(f"{side.name}: the {name} process exited{side.logs()}")
        ev = side.event(name, record)
        if ev is None or ev[1] not in got:
            continue
        kind, rid = ev
        got[rid][kind] = at
        if kind == "first":
            got[rid]["hit_tokens"] = record.get("hit_tokens", 0)
            if "total_ms" in record:
                got[rid]["worker_ms"] = (record["total_ms"], record["forward_ms"], record["batch"])
        else:
            got[rid]["tokens"] = record["tokens"]
            got[rid].setdefault("hit_tokens", record.get("hit_tokens", 0))
            pending.discard(rid)
    for r in got.values():
        r.setdefault("first", r["done"])
    return got


def summarize(
    requests: list[Request], got: dict[str, dict[str, Any]], slo_ttft_ms: float, slo_tpot_ms: float, window_s: float
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    ttft, tpot, e2e, good, tokens, hits = [], [], [], 0, 0, 0
    for req in requests:
        g = got[req.request_id]
        t_first, t_done = g["first"] - g["sent"], g["done"] - g["sent"]
        n = len(g["tokens"])
        ttft.append(t_first)
        e2e.append(t_done)
        per_token = (t_done - t_first) // (n - 1) if n > 1 else 0
        if n > 1:
            tpot.append(per_token)
        good += t_first <= slo_ttft_ms * 1e6 and per_token <= slo_tpot_ms * 1e6
        tokens += n
        hits += g["hit_tokens"]
    span = max(got[r.request_id]["done"] for r in requests) - min(got[r.request_id]["sent"] for r in requests)
    arrivals = max(requests[-1].at_s, window_s)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    stats: dict[str, Any] = {
        "requests": len(requests),
        "offered_rps": len(requests) / arrivals,
        "goodput_rps": good / arrivals,
        "slo_met": good / len(requests),
        "output_tokens_per_s": tokens / span * 1e9,
        "hit_rate": hits / prompt_tokens,
        "prompt_tokens": prompt_tokens,
    }
    inside = [got[r.request_id]["worker_ms"] for r in requests if "worker_ms" in got[r.request_id]]
    if inside:
        # the prefill worker's own view: arrival to handoff, its last step's forward, requests in that step
        for i, key in enumerate(("prefill_total_ms", "prefill_step_ms", "prefill_batch")):
            stats[f"{key}_p50"] = timings.percentile(sorted(x[i] for x in inside), 50)
    for key, samples in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        stats |= {f"{key}_{k}": v for k, v in timings.summarize_ns(samples).items() if k != "n"}
    return stats, {"ttft_ns": timings.thin(ttft), "tpot_ns": timings.thin(tpot), "e2e_ns": timings.thin(e2e)}


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
    _targets(report)
    report.print_block("e2e", _body(report))
    report.save(_plot(report))
    return 0


@contextlib.contextmanager
def _sides(env: Env, scenario: str) -> Iterator[dict[str, Side]]:
    made: dict[str, Side] = {}
    gpu = env.device.torch_device
    try:
        if scenario == "1":
            made["pool"] = _pool_side(env, "pool", 1, 1, None)
            made["mono"] = _mono_side(env, "mono", [gpu])
        elif scenario == "2":
            made["pool-2gpu"] = _pool_side(env, "pool-2gpu", 1, 1, (0, 1))
            if env.cfg["push_too"]:
                made["pool-2gpu-push"] = _pool_side(env, "pool-2gpu-push", 1, 1, (0, 1), push=True)
            made["mono-x2"] = _mono_side(env, "mono-x2", ["cuda:0", "cuda:1"])
        elif scenario == "3":
            made["shared-2p"] = _pool_side(env, "shared-2p", 1, 2, None)
            made["private-2p"] = _pool_side(env, "private-2p", 2, 1, None)
        else:
            raise SystemExit(f"e2e: no scenario {scenario!r} (1, 2 or 3)")
        yield made
    finally:
        for side in made.values():
            side.stop()


def _scenario(report: harness.Report, env: Env, scenario: str, vocab: int) -> None:
    cfg, args = env.cfg, report.args
    one_token = scenario == "3"
    rates = cfg["prefill_rates"] if one_token else cfg["rates"]
    with _sides(env, scenario) as sides:
        warmup = {**cfg, "duration_s": 0, "min_requests": cfg["warmup_requests"]}
        warm = make_workload("unique", 1000.0, warmup, vocab, -1)
        for side in sides.values():
            for r in warm:
                r.request_id = f"warm-{side.name}-{r.request_id}"
            drive(side, warm, args.timeout_s)
        steps = len(rates) * len(WORKLOADS) * len(sides)
        with harness.progress(steps, f"e2e scenario {scenario}", args.no_progress) as bar:
            for k, rate in enumerate(rates):
                for workload in timings.rotated(WORKLOADS, k):
                    requests = make_workload(workload, rate, cfg, vocab, args.seed * 10 + int(scenario))
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


def _rates(cfg: dict[str, Any], scenario: str) -> list[float]:
    return cfg["prefill_rates"] if scenario == "3" else cfg["rates"]


def _row(report: harness.Report, scenario: str, side: str, workload: str, rate: float) -> dict[str, Any] | None:
    for r in report.results:
        if (r["scenario"], r["side"], r["workload"], r["rate"]) == (scenario, side, workload, rate):
            return r
    return None


def _targets(report: harness.Report) -> None:
    cfg = report.config
    scen = cfg["scenarios"]
    differ = [n for n in report.notes if "tokens differ" in n]
    report.targets.append(
        harness.Target(
            "every side produces the same tokens", "identical", "identical" if not differ else "DIFFERENT",
            not differ, "; ".join(differ),
        )
    )  # fmt: skip
    for s, side in (("1", "pool"), ("3", "shared-2p")):
        if s not in scen:
            continue
        for rate in _rates(cfg, s):
            mixed, unique = _row(report, s, side, "mixed", rate), _row(report, s, side, "unique", rate)
            if mixed is None or unique is None:
                continue
            ratio = mixed["ttft_p50_us"] / unique["ttft_p50_us"]
            report.targets.append(
                harness.Target(
                    f"scenario {s}, {side}: TTFT p50 with {mixed['hit_rate']:.0%} hits / unique, {rate:g} req/s",
                    "<= 0.5x (at >= 70% hits)",
                    f"{ratio:.2f}x",
                    ratio <= 0.5 if mixed["hit_rate"] >= 0.7 else None,
                    f"{mixed['ttft_p50_us'] / 1e3:.1f} ms vs {unique['ttft_p50_us'] / 1e3:.1f} ms",
                )
            )
    for s in scen:
        ours, base = SIDES[s]
        best = None
        for rate in _rates(cfg, s):
            for w in WORKLOADS:
                a, b = _row(report, s, ours, w, rate), _row(report, s, base, w, rate)
                if a and b and (best is None or a["goodput_rps"] > best[0]["goodput_rps"]):
                    best = (a, b)
        if best is None:
            continue
        a, b = best
        ratio = a["goodput_rps"] / b["goodput_rps"] if b["goodput_rps"] else float("inf")
        report.targets.append(
            harness.Target(
                f"scenario {s}: {ours} / {base} goodput at {ours}'s best ({a['workload']}, {a['rate']:g} req/s)",
                ">= 1.3x" if s == "2" else ">= 1x",
                f"{ratio:.2f}x",
                ratio >= (1.3 if s == "2" else 1.0),
                f"{a['goodput_rps']:.2f} vs {b['goodput_rps']:.2f} req/s within SLO",
            )
        )


def _body(report: harness.Report) -> str:
    cfg = report.config
    head = ["scen", "workload", "rate", "side", "goodput", "SLO met", "out tok/s", "TTFT p50", "TTFT p99",
            "TPOT p50", "TPOT p99", "E2E p50", "E2E p99", "hits", "prefix mem", "pf step/batch"]  # fmt: skip
    rows = []

    def tpot(r: dict[str, Any], q: str) -> str:
        return harness.fmt_us(r[f"tpot_{q}_us"]) if f"tpot_{q}_us" in r else "-"

    for r in sorted(report.results, key=lambda r: (r["scenario"], r["workload"], r["rate"], r["side"])):
        cached = r.get("prefix_bytes_stored")
        rows.append(
            [
                r["scenario"],
                r["workload"],
                f"{r['rate']:g}/s",
                r["side"],
                f"{r['goodput_rps']:.2f}/s",
                f"{r['slo_met']:.0%}",
                f"{r['output_tokens_per_s']:.0f}",
                harness.fmt_us(r["ttft_p50_us"]),
                harness.fmt_us(r["ttft_p99_us"]),
                tpot(r, "p50"),
                tpot(r, "p99"),
                harness.fmt_us(r["e2e_p50_us"]),
                harness.fmt_us(r["e2e_p99_us"]),
                f"{r['hit_rate']:.0%}",
                "-" if cached is None else harness.fmt_bytes(cached),
                f"{r['prefill_step_ms_p50']:.1f}ms/{r['prefill_batch_p50']:g}" if "prefill_step_ms_p50" in r else "-",
            ]
        )
    return (
        f"{cfg['model']}, prompts ~{cfg['prompt_len']} tokens, outputs ~{cfg['max_new_tokens']} tokens (scenario 3: "
        f"1), {cfg['duration_s']:g} s of Poisson arrivals per rate, SLO TTFT <= {cfg['slo_ttft_ms']:g} ms and "
        f"TPOT <= {cfg['slo_tpot_ms']:g} ms, mixed = {cfg['mix']}:\n" + harness.table(head, rows)
    )


def _plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    scen = report.config["scenarios"]
    fig, axes = plt.subplots(2, len(scen), figsize=(6 * len(scen), 8), squeeze=False)
    for col, s in enumerate(scen):
        for side in sorted({r["side"] for r in report.results if r["scenario"] == s}):
            for w, style in zip(WORKLOADS, ("--", "-"), strict=True):
                rows = sorted((r for r in report.results if (r["scenario"], r["side"], r["workload"]) == (s, side, w)),
                              key=lambda r: r["rate"])  # fmt: skip
                if not rows:
                    continue
                rates = [r["rate"] for r in rows]
                axes[0][col].plot(rates, [r["goodput_rps"] for r in rows], style, marker="o", label=f"{side} {w}")
                axes[1][col].plot(rates, [r["ttft_p50_us"] / 1e3 for r in rows], style, marker="o",
                                  label=f"{side} {w}")  # fmt: skip
        offered = _rates(report.config, s)
        axes[0][col].plot(offered, offered, ":", color="grey", label="offered")
        axes[0][col].set(title=f"scenario {s}: goodput", xlabel="arrival rate (req/s)", ylabel="req/s within SLO")
        axes[1][col].set(title=f"scenario {s}: TTFT p50", xlabel="arrival rate (req/s)", ylabel="ms")
        axes[1][col].set_yscale("log")
        for ax in axes[:, col]:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"kvpool e2e, {report.config['model']} ({machine.describe_device(machine.device_info(report.device))})"
    )
    fig.tight_layout()
    return fig
