"""vllm: vLLM engines as users run them, with and without the kvpool connector, on one GPU or two.

Engine configurations (--engines; each is one entry of ENGINES in this module; by default every one whose GPUs this
process sees, counted from --gpu):
  plain   vLLM with its own prefix cache, no connector
  cold    vLLM with prefix caching off: every prompt computed
  copy    vLLM with the kvpool connector: prefixes and prefilled requests go through one pool, copied between
          vLLM's cache and the arena
  resident  vLLM with the kvpool connector in resident mode: each engine's KV cache is the pool's arena (kv_packed,
          --num-gpu-blocks-override = the arena's blocks), and prefixes and prefills move by block id, never copied
  peers   two GPUs: resident mode, the writer on the first GPU and the reader on the second, one pool with an arena
          on each (--devices): a prefix computed on one GPU reaches the other in one batched peer copy
  offload two GPUs: vLLM's CPU offloading connector on each engine (a CPU cache of --offload-bytes, a GPU cache of
          --pool-blocks), the writer on the first GPU and the reader on the second, sharing nothing: what a node
          with an engine per GPU has without kvpool

A configuration with a connector runs two engines (a writer and a reader; with the kvpool connector on one pool);
one without runs one engine, which is both. Each engine's core process runs on its configuration's GPU (plain,
cold, copy and resident: the first). All engines start first and stay up; each round runs every configuration once,
each round starting with the next one, so that no configuration always goes first.

Workload: a random model shaped like Llama-3.2-1B in bf16 (kept in --work), or a local checkpoint (--model);
token-id prompts, greedy, every request generating --new-tokens, CUDA graphs on (--eager: off). Each round
draws --requests prompts of --prompt-len tokens: prompts A and B share their first --prefix-share of tokens,
prompts P share nothing with anything.
  prefix   A on the writer, then B on the reader: B's prefix is one that another engine computed (through the
           pool), or one that the same engine computed (vLLM's own cache; nothing with prefix caching off). B is
           sent all at once (a burst) or one request every 1/rate s (--arrivals burst,8 runs both).
  pair     P prefilled on the writer (one token, handed off with do_remote_decode), then decoded on the reader
           with the prefill's kv_transfer_params; without the connector, P twice on the one engine. Only where
           both engines are on one GPU (one arena): not for peers and offload.
  singles  --singles requests of B and of P (P where the pair runs), one at a time, so that no batch composition
           differs.

Measures: TTFT p50/p99 and TPOT p50/p99 from vLLM's own timestamps; the share of prompt tokens vLLM did not
compute (its num_cached_tokens), and with the kvpool connector what the pool committed, hit and copied between
GPUs; greedy tokens against the plain engine's (what vLLM's own cache gives).

Needs vLLM (pip install -e '.[vllm]' from a checkout) and a CUDA GPU; --help needs neither.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.benchmarks import harness, machine, nixl, timings
from kvpool.layout import KVLayout

# -- what users run -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """One way of running vLLM. ``connector`` is the kvpool connector's ``kv_connector_extra_config`` (None: no
    kvpool connector); ``offload``: vLLM's CPU offloading connector on each engine instead; ``gpus``: the GPU of
    each engine, the writer's first, then the reader's (one entry: one engine that is both; by default one engine
    without the kvpool connector, two on one GPU with it), counted from the run's ``--gpu``; ``pool_flags`` go to
    that configuration's ``kvpool serve``, ``engine_args`` to ``vllm.LLM``."""

    help: str
    prefix_caching: bool = True
    connector: dict[str, Any] | None = None
    offload: bool = False
    gpus: tuple[int, ...] = ()
    pool_flags: tuple[str, ...] = ()
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.gpus:
            object.__setattr__(self, "gpus", (0,) if self.connector is None else (0, 0))
        if len(self.gpus) not in (1, 2) or min(self.gpus) < 0:
            raise ValueError(f"gpus: one GPU ordinal per engine, the writer's then the reader's, got {self.gpus}")

    @property
    def engines(self) -> int:
        return len(self.gpus)

    @property
    def resident(self) -> bool:
        return (self.connector or {}).get("mode") == "resident"

    @property
    def spans_gpus(self) -> bool:
        return len(set(self.gpus)) > 1

    @property
    def pairs(self) -> bool:
        """Whether the pair workload runs: a prefill's blocks are in the arena of its decode engine only where both
        engines are on one GPU."""
        return not self.spans_gpus

    @property
    def gpus_needed(self) -> int:
        return max(self.gpus) + 1

    def placed(self, first: int = 0) -> tuple[int, ...]:
        """The CUDA ordinals (this process's) of the engines, for a run whose first GPU is ``first`` (``--gpu``)."""
        return tuple(first + g for g in self.gpus)

    def pool_args(self, blocks: int, first: int = 0) -> list[str]:
        """This configuration's ``kvpool serve`` flags for an arena of ``blocks`` blocks on each of its GPUs (a
        resident engine's slab may hold all of them, and its vLLM is told the arena's block count)."""
        extra = ["--order", "kv_packed", "--slabs", "--slab-regions", "8", "--slab-max-blocks", str(blocks)]
        on = sorted(set(self.placed(first)))
        devices = ["--devices", ",".join(map(str, on))] if self.spans_gpus else []
        return ["--num-blocks", str(blocks), *devices, *self.pool_flags, *(extra if self.resident else [])]


ENGINES: dict[str, EngineConfig] = {
    "plain": EngineConfig("vLLM with its own prefix cache, no connector"),
    "cold": EngineConfig("vLLM with prefix caching off", prefix_caching=False),
    "copy": EngineConfig("vLLM with the kvpool connector, copying between vLLM's cache and the arena", connector={}),
    "resident": EngineConfig(
        "vLLM with the kvpool connector in resident mode: its KV cache is the arena, blocks move by id",
        connector={"mode": "resident"},
    ),
    "peers": EngineConfig(
        "resident mode on two GPUs, one pool with an arena on each: a prefix crosses in one batched peer copy",
        connector={"mode": "resident"},
        gpus=(0, 1),
    ),
    "offload": EngineConfig(
        "vLLM's CPU offloading connector on an engine per GPU, sharing nothing", offload=True, gpus=(0, 1)
    ),
}
#: the configuration whose tokens the others are compared with, and those TTFT ratios are taken against
REFERENCE, COLD, OFFLOAD = "plain", "cold", "offload"

LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
BLOCK_SIZE = 16
#: the writer's kv_transfer_params for a prefill that a decode engine continues
PARK = {"do_remote_decode": True}


# -- options ----------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines", type=names, default=None,
        help=f"comma list of {', '.join(ENGINES)} [every one whose GPUs this process sees]",
    )  # fmt: skip
    parser.add_argument("--arrivals", type=arrivals, default=["burst"], help="comma list: burst, or requests/s [burst]")
    parser.add_argument("--requests", type=int, default=None, help="prompts per round [32; quick 4]")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt [1024; quick 256]")
    parser.add_argument("--prefix-share", type=share, default=0.75, help="share of B's tokens that A has [0.75]")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens each request generates [64; quick 8]")
    parser.add_argument("--singles", type=int, default=None, help="requests of B and P served one at a time [8]")
    parser.add_argument("--model", type=Path, default=None, help="local checkpoint [a random Llama-3.2-1B shape]")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvpool-bench-vllm"), help="where the model is kept")
    parser.add_argument(
        "--pool-blocks", type=int, default=16384, help="blocks of each configuration's pool (each arena)"
    )
    parser.add_argument(
        "--offload-bytes", type=harness.parse_size, default=None,
        help="CPU cache of each offload engine (8GiB) [as large as its GPU cache: --pool-blocks blocks]",
    )  # fmt: skip
    parser.add_argument("--engine-memory", type=float, default=0.18, help="gpu_memory_utilization of each engine")
    parser.add_argument("--attention-backend", default="TRITON_ATTN", help="vLLM's attention backend [TRITON_ATTN]")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    parser.add_argument(
        "--memory", action="store_true",
        help="instead: two resident engines on one arena of --pool-blocks against two plain engines with half as many "
        "blocks each, on many system prompts that fit once in the arena and not twice",
    )  # fmt: skip
    parser.add_argument("--memory-requests", type=int, default=192, help="requests of the --memory workload [192]")


def names(text: str) -> list[str]:
    got = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in got if n not in ENGINES]
    if unknown or not got:
        raise argparse.ArgumentTypeError(f"engine configurations are {', '.join(ENGINES)}; got {text!r}")
    return got


def chosen(asked: list[str] | None, first: int, visible: int) -> list[str]:
    """The configurations to run when this process sees ``visible`` GPUs and the run starts at ``first``: those
    asked for, or by default every one whose engines all have a GPU; one asked for that does not fit stops the run
    before anything starts."""
    fits = {name: first + config.gpus_needed <= visible for name, config in ENGINES.items()}
    if asked is None:
        return [name for name in ENGINES if fits[name]]
    short = [name for name in asked if not fits[name]]
    if short:
        need = max(ENGINES[name].gpus_needed for name in short)
        raise SystemExit(
            f"kvpool bench vllm: {' and '.join(short)} need{'s' if len(short) == 1 else ''} {need} GPUs (an engine "
            f"on each) from --gpu {first}, and this process sees {visible}: leave "
            f"{'it' if len(short) == 1 else 'them'} out of --engines, or run on a node with {first + need} GPUs"
        )
    return asked


def arrivals(text: str) -> list[str | float]:
    out: list[str | float] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "burst":
            out.append(part)
            continue
        try:
            rate = float(part)
        except ValueError:
            rate = 0.0
        if rate <= 0:
            raise argparse.ArgumentTypeError(f"an arrival is 'burst' or requests per second (8), got {part!r}")
        out.append(rate)
    if not out:
        raise argparse.ArgumentTypeError("give at least one arrival: burst, or requests per second")
    return out


def share(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1 (0.75), got {text!r}")
    return value


def label(arrival: str | float) -> str:
    return "burst" if arrival == "burst" else f"{arrival:g}/s"


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    prompt_len = args.prompt_len or (256 if quick else 1024)
    return {
        "engines": args.engines,
        "arrivals": args.arrivals,
        "rounds": args.rounds or (1 if quick else 3),
        "requests": args.requests or (4 if quick else 32),
        "prompt_len": prompt_len,
        "prefix_len": int(prompt_len * args.prefix_share),
        "new_tokens": args.new_tokens or (8 if quick else 64),
        "singles": args.singles if args.singles is not None else (2 if quick else 8),
        "block_size": BLOCK_SIZE,
        "pool_blocks": args.pool_blocks,
        "offload_bytes": args.offload_bytes,
        "gpus": {name: list(ENGINES[name].placed(args.gpu)) for name in args.engines},
        "engine_memory": args.engine_memory,
        "attention_backend": args.attention_backend,
        "cuda_graphs": not args.eager,
        "seed": args.seed,
    }


# -- the workload ---------------------------------------------------------------------------------------------


def prompts(seed: int, n: int, prompt_len: int, prefix_len: int) -> dict[str, list[list[int]]]:
    """A and B: ``n`` prompts each, the i-th of both opening with the same ``prefix_len`` tokens; P: unrelated."""
    rng = random.Random(seed)

    def ids(length: int) -> list[int]:
        return [rng.randrange(10, 128000) for _ in range(length)]

    pre = [ids(prefix_len) for _ in range(n)]
    return {
        "A": [p + ids(prompt_len - prefix_len) for p in pre],
        "B": [p + ids(prompt_len - prefix_len) for p in pre],
        "P": [ids(prompt_len) for _ in range(n)],
    }


def pool_layout(model_config: dict[str, Any], block_size: int) -> KVLayout:
    """The arena a model's KV needs, from its ``config.json``."""
    heads = model_config["num_attention_heads"]
    dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16"
    return KVLayout(
        num_layers=model_config["num_hidden_layers"],
        num_kv_heads=model_config.get("num_key_value_heads") or heads,
        head_dim=model_config.get("head_dim") or model_config["hidden_size"] // heads,
        block_size=block_size,
        dtype=dtype,
    )


def outcome(outs: Sequence[Any], wall_s: float) -> dict[str, Any]:
    """Per request, in order: tokens, TTFT and TPOT (vLLM's own timestamps), prompt tokens vLLM did not compute,
    and the engine core's stamps (queued, scheduled, first token), which say how vLLM split a burst into steps."""
    tpot = []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        if n > 1:
            tpot.append((o.metrics.last_token_ts - o.metrics.first_token_ts) * 1e3 / (n - 1))
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kv_transfer_params": [o.kv_transfer_params for o in outs],
        "ttft_ms": [o.metrics.first_token_latency * 1e3 for o in outs],
        "tpot_ms": tpot,
        "cached": [max(0, getattr(o, "num_cached_tokens", 0) or 0) for o in outs],
        "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        "core_ts": [(o.metrics.queued_ts, o.metrics.scheduled_ts, o.metrics.first_token_ts) for o in outs],
        "wall_s": wall_s,
    }


# -- vLLM (imported only here) ----------------------------------------------------------------------------------


def require_vllm() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise SystemExit(f"kvpool bench vllm: needs vLLM ({exc}): pip install -e '.[vllm]' from a checkout") from None
    return str(vllm.__version__)


def build_model(path: Path) -> None:
    """A random model of Llama-3.2-1B's shape in bf16, saved where vLLM loads it from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


@contextlib.contextmanager
def on_gpu(ordinal: int) -> Iterator[str]:
    """``CUDA_VISIBLE_DEVICES`` naming this process's GPU ``ordinal`` alone (through this process's own
    ``CUDA_VISIBLE_DEVICES`` when set), restored on the way out: an engine started inside runs there, since vLLM's
    engine core is a child process that takes the first GPU it sees. This process keeps the GPUs it saw (CUDA read
    the variable when it started), and so does an engine after it started."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    target = str(ordinal)
    if before is not None:
        visible = [part.strip() for part in before.split(",") if part.strip()]
        if not 0 <= ordinal < len(visible):
            raise SystemExit(
                f"kvpool bench vllm: an engine's GPU {ordinal} is not among CUDA_VISIBLE_DEVICES={before!r} "
                f"({len(visible)} visible)"
            )
        target = visible[ordinal]
    os.environ["CUDA_VISIBLE_DEVICES"] = target
    try:
        yield target
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def engine(config: EngineConfig, model: Path, cfg: dict[str, Any], pool_url: str | None) -> Any:
    from vllm import LLM

    # the suite asks each engine's core what its connector did (LLM.collective_rpc of a function, sent pickled)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # a fresh engine core process, which reads CUDA_VISIBLE_DEVICES when it starts (see on_gpu)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(config.engine_args)
    if config.resident or config.offload:  # an offload engine's GPU cache: as large as a resident engine's arena
        kw["num_gpu_blocks_override"] = cfg["pool_blocks"]
    if config.connector is not None:
        extra = {"url": pool_url, "reserve_blocks": 4096, **config.connector}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
        )  # fmt: skip
    elif config.offload:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": cfg["offload_bytes"]},
        )  # fmt: skip
    return LLM(
        model=str(model), skip_tokenizer_init=True, attention_backend=cfg["attention_backend"],
        gpu_memory_utilization=cfg["engine_memory"], enable_prefix_caching=config.prefix_caching,
        max_num_batched_tokens=16384, block_size=cfg["block_size"],
        max_model_len=max(2048, cfg["prompt_len"] + cfg["new_tokens"]), seed=0, enforce_eager=not cfg["cuda_graphs"],
        disable_log_stats=False, **kw,
    )  # fmt: skip


def sampling(max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def generate(llm: Any, batch: list[list[int]], max_tokens: int, params: Sequence[dict | None] = ()) -> dict:
    """The whole batch in one ``generate``: every request is there at t0."""
    sps = [sampling(max_tokens, p) for p in (params or [None] * len(batch))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sps, use_tqdm=False)
    return outcome(outs, time.perf_counter() - t0)


_steady_ids = itertools.count()


def steady(llm: Any, batch: list[list[int]], rate: float, max_tokens: int) -> dict:
    """One request every ``1/rate`` s, added between engine steps as a server's engine core takes them in; each
    request's arrival is when it was due, so a step that runs past it counts in its TTFT, as for a client."""
    eng = llm.llm_engine
    names_ = [f"steady-{next(_steady_ids)}" for _ in batch]
    sp = sampling(max_tokens, None)
    done: dict[str, Any] = {}
    t0, wall0, sent = time.perf_counter(), time.time(), 0
    while len(done) < len(batch):
        now = time.perf_counter() - t0
        while sent < len(batch) and sent / rate <= now:
            eng.add_request(names_[sent], {"prompt_token_ids": batch[sent]}, sp, arrival_time=wall0 + sent / rate)
            sent += 1
        if eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        elif sent < len(batch):
            time.sleep(max(0.0, sent / rate - (time.perf_counter() - t0)))
    return outcome([done[n] for n in names_], time.perf_counter() - t0)


def close(llm: Any) -> None:
    import torch

    with contextlib.suppress(Exception):  # best effort: the process is ending anyway
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@dataclass
class Setup:
    """One configuration's engines (the writer and the reader, one engine twice without a connector) and pool."""

    name: str
    config: EngineConfig
    writer: Any
    reader: Any
    pool: harness.Server | None
    start_s: float

    def committed(self) -> int:
        return int(self.pool.stats()["counters"]["committed_blocks"]) if self.pool else 0

    def counters(self) -> dict[str, int]:
        return dict(self.pool.stats()["counters"]) if self.pool else {}

    def connector_counters(self) -> dict[str, dict[str, int]]:
        """What each engine's connector did (in resident mode: blocks installed, committed, copied: 0)."""
        if self.config.connector is None:
            return {}
        from kvpool.integrations.vllm.connector import counters

        out = {"writer": self.writer.collective_rpc(counters)[0]}
        if self.reader is not self.writer:
            out["reader"] = self.reader.collective_rpc(counters)[0]
        return out

    def settle(self, timeout_s: float = 5.0) -> None:
        """Until the pool's books stop moving (an engine's commits and releases reach it after its requests end)."""
        end, last = time.monotonic() + timeout_s, None
        while self.pool is not None and time.monotonic() < end:
            now = self.counters()
            if now == last:
                return
            last = now
            time.sleep(0.05)

    def wait_commits(self, before: int, n: int, timeout_s: float = 10.0) -> None:
        """Until the writer's saves reached the pool: the reader is to find them there, as it would long after in
        a server."""
        end = time.monotonic() + timeout_s
        while self.pool is not None and self.committed() < before + n and time.monotonic() < end:
            time.sleep(0.01)


@contextlib.contextmanager
def setups(names_: Sequence[str], model: Path, cfg: dict[str, Any], device: machine.Device) -> Iterator[list[Setup]]:
    """Every configuration's engines, each on its GPU, started one after the other and all stopped on the way out."""
    layout = pool_layout(json.loads((model / "config.json").read_text()), cfg["block_size"])
    made: list[Setup] = []
    with contextlib.ExitStack() as stack:
        for name in names_:
            config = ENGINES[name]
            gpus = config.placed(device.index)
            pool = None
            if config.connector is not None:
                flags = [*harness.layout_flags(layout), "--model", str(model),
                         *config.pool_args(cfg["pool_blocks"], device.index)]  # fmt: skip
                pool = harness.start_pool(device, *flags)
                stack.callback(pool.stop)
            t = time.perf_counter()
            with on_gpu(gpus[0]):
                writer = engine(config, model, cfg, pool.url if pool else None)
            stack.callback(close, writer)
            reader = writer
            if config.engines == 2:
                with on_gpu(gpus[1]):
                    reader = engine(config, model, cfg, pool.url if pool else None)
                stack.callback(close, reader)
            made.append(Setup(name, config, writer, reader, pool, round(time.perf_counter() - t, 1)))
        yield made


def prefix_round(s: Setup, ps: dict[str, list[list[int]]], arrival: str | float, cfg: dict[str, Any]) -> dict:
    """A on the writer, then B on the reader; the pool's counters around B."""
    before = s.committed()
    generate(s.writer, ps["A"], cfg["new_tokens"])
    s.wait_commits(before, len(ps["A"]) * (cfg["prompt_len"] // cfg["block_size"]))
    c1 = s.counters()
    got = generate(s.reader, ps["B"], cfg["new_tokens"]) if arrival == "burst" else (
        steady(s.reader, ps["B"], float(arrival), cfg["new_tokens"]))  # fmt: skip
    s.settle()
    if s.pool is not None:
        c2 = s.counters()
        got["pool"] = {"committed_by_A": c1["committed_blocks"] - before,
                       "committed_by_B": c2["committed_blocks"] - c1["committed_blocks"],
                       "hit_blocks_B": c2["hit_blocks"] - c1["hit_blocks"]}  # fmt: skip
        got["pool"] |= {f"{k}_B": c2.get(k, 0) - c1.get(k, 0) for k in ("peer_copies", "peer_copied_blocks")}
    return got


def pair_round(s: Setup, batch: list[list[int]], cfg: dict[str, Any]) -> dict[str, dict]:
    """P prefilled on the writer (one token), then decoded on the reader with what the prefill answered."""
    park = [PARK] * len(batch) if s.config.connector is not None else []
    pre = generate(s.writer, batch, 1, park)
    params = pre["kv_transfer_params"] if park else []
    return {"prefill": pre, "decode": generate(s.reader, batch, cfg["new_tokens"], params)}


def singles(s: Setup, ps: dict[str, list[list[int]]], cfg: dict[str, Any]) -> dict[str, list[dict]]:
    """B (after its A) and, where the pair runs, its P, one request at a time: tokens that no batch composition
    changes."""
    out: dict[str, list[dict]] = {"B": [], "P": []} if s.config.pairs else {"B": []}
    for i in range(cfg["singles"]):
        before = s.committed()
        generate(s.writer, ps["A"][i : i + 1], cfg["new_tokens"])
        s.wait_commits(before, cfg["prompt_len"] // cfg["block_size"])
        out["B"].append(generate(s.reader, ps["B"][i : i + 1], cfg["new_tokens"]))
        if s.config.pairs:
            out["P"].append(pair_round(s, ps["P"][i : i + 1], cfg)["decode"])
    return out


def measure(args: argparse.Namespace, cfg: dict[str, Any], model: Path, device: machine.Device) -> dict[str, Any]:
    """Every configuration's figures: the rounds interleaved, each starting with the next configuration. Every
    configuration gets the same prompts, and no prompt is sent twice to one engine (it would hit whole)."""
    raw: dict[str, Any] = {}
    n, plen, pre, base = cfg["requests"], cfg["prompt_len"], cfg["prefix_len"], cfg["seed"] * 100_000
    with setups(cfg["engines"], model, cfg, device) as made:
        for s in made:
            raw[s.name] = {"start_s": s.start_s, "prefix": {label(a): [] for a in cfg["arrivals"]}}
            if s.config.pairs:  # engines on two GPUs run no pair: no key, no row
                raw[s.name]["pair"] = []
            warm = prompts(base + 99_999, n, plen, pre)
            prefix_round(s, warm, "burst", cfg)
            if s.config.pairs:
                pair_round(s, warm["P"], cfg)
            # a lone request too: a decode engine given a handoff at once runs the first of a burst alone, and
            # vLLM would build its kernels for that batch in a measured round (a step of ~370 ms on an H200)
            singles(s, prompts(base + 99_998, 1, plen, pre), {**cfg, "singles": 1})
        steps = cfg["rounds"] * len(made) + len(made)
        with harness.progress(steps, "vllm", args.no_progress) as bar:
            for r in range(cfg["rounds"]):
                each = [prompts(base + 100 * r + k, n, plen, pre) for k in range(len(cfg["arrivals"]))]
                for s in timings.rotated(made, r):
                    for arrival, ps in zip(cfg["arrivals"], each, strict=True):
                        raw[s.name]["prefix"][label(arrival)].append(prefix_round(s, ps, arrival, cfg))
                    if s.config.pairs:
                        raw[s.name]["pair"].append(pair_round(s, each[0]["P"], cfg))
                    bar.update()
            one = prompts(base + 90_000, max(1, cfg["singles"]), plen, pre)
            for s in made:
                if cfg["singles"]:
                    raw[s.name]["singles"] = singles(s, one, cfg)
                raw[s.name]["pool_stats"] = s.pool.stats() if s.pool else None
                raw[s.name]["connector"] = s.connector_counters()
                bar.update()
    return raw


def system_prompts(seed: int, pool_blocks: int, block_size: int, prompt_len: int) -> list[list[int]]:
    """As many system prompts of ``prompt_len`` tokens as fill three quarters of an arena: once they fit, twice not."""
    rng = random.Random(seed)
    count = max(2, int(0.75 * pool_blocks * block_size / prompt_len))
    return [[rng.randrange(10, 128000) for _ in range(prompt_len)] for _ in range(count)]


def memory(cfg: dict[str, Any], model: Path, device: machine.Device, requests: int) -> dict[str, Any]:
    """Two engines behind a router that sends each request to either: resident (one arena of ``pool_blocks``,
    every system prompt held once for both) against two plain engines with private caches of half as many blocks
    each (the same memory). Each request is a random system prompt and a question of its own; waves of 16, half to
    each engine. Per configuration: the share of prompt tokens not computed, and TTFT."""
    n, bs = cfg["pool_blocks"], cfg["block_size"]
    prompt_len = cfg["prompt_len"]
    sys = system_prompts(cfg["seed"] + 7, n, bs, prompt_len)
    rng = random.Random(cfg["seed"])
    waves = []
    for _ in range(max(1, requests // 16)):
        waves.append([sys[rng.randrange(len(sys))] + [rng.randrange(10, 128000) for _ in range(64)] for _ in range(16)])
    layout = pool_layout(json.loads((model / "config.json").read_text()), bs)
    out: dict[str, Any] = {"system_prompts": len(sys), "system_prompt_blocks": len(sys) * (prompt_len // bs)}
    for name in ("resident", "private"):
        with contextlib.ExitStack() as stack:
            if name == "resident":
                config = ENGINES["resident"]
                pool = harness.start_pool(device, *harness.layout_flags(layout), "--model", str(model),
                                          *config.pool_args(n))  # fmt: skip
                stack.callback(pool.stop)
                with on_gpu(device.index):
                    engines = [engine(config, model, cfg, pool.url) for _ in range(2)]
            else:
                half = EngineConfig(
                    "a plain engine with half the blocks", engine_args={"num_gpu_blocks_override": n // 2}
                )
                with on_gpu(device.index):
                    engines = [engine(half, model, cfg, None) for _ in range(2)]
            for e in engines:
                stack.callback(close, e)
            runs = []
            for wave in waves:
                for i, e in enumerate(engines):
                    runs.append(generate(e, wave[i * 8 : (i + 1) * 8], 8))
            half_runs = len(runs) // 2  # the second half: after the caches warmed
            cached, tokens = sum(_cat(runs[half_runs:], "cached")), sum(_cat(runs[half_runs:], "prompt_tokens"))
            ttft = _cat(runs[half_runs:], "ttft_ms")
            out[name] = {"cached_share": round(cached / max(1, tokens), 3), "ttft_p50_ms": p(ttft, 50),
                         "ttft_p99_ms": p(ttft, 99), "n": len(ttft)}  # fmt: skip
    return out


# -- figures (no vLLM needed) -------------------------------------------------------------------------------------


def p(values: Sequence[float], q: float) -> float:
    return round(timings.percentile(sorted(values), q), 2)


def _cat(runs: list[dict], key: str) -> list[Any]:
    return [x for r in runs for x in r[key]]


def same(mine: list[list[int]], theirs: list[list[int]]) -> str:
    return f"{sum(a == b for a, b in zip(mine, theirs, strict=True))}/{len(mine)}"


def figures(name: str, workload: str, runs: list[dict], reference: list[dict] | None) -> dict[str, Any]:
    """One row of the table: a configuration's requests of one workload over all rounds."""
    ttft, tpot = _cat(runs, "ttft_ms"), _cat(runs, "tpot_ms")
    cached, tokens = sum(_cat(runs, "cached")), sum(_cat(runs, "prompt_tokens"))
    row: dict[str, Any] = {
        "engine": name, "workload": workload, "n": len(ttft),
        "ttft_p50_ms": p(ttft, 50), "ttft_p99_ms": p(ttft, 99), "tpot_p50_ms": p(tpot, 50), "tpot_p99_ms": p(tpot, 99),
        "round_ttft_p50_ms": [p(r["ttft_ms"], 50) for r in runs], "cached_share": round(cached / max(1, tokens), 3),
    }  # fmt: skip
    if reference is not None:
        row["same_tokens_as_plain"] = same(_cat(runs, "tokens"), _cat(reference, "tokens"))
    if runs and "pool" in runs[0]:
        row["pool"] = [r["pool"] for r in runs]
    return row


def workloads(res: dict[str, Any]) -> dict[str, list[dict]]:
    """A configuration's runs by workload: prefix sharing per arrival, the pair's two sides, the single requests;
    only those that ran (engines on two GPUs run no pair)."""
    out = {f"prefix {arrival}": runs for arrival, runs in res["prefix"].items()}
    out |= {f"pair {side}": [r[side] for r in res.get("pair", [])] for side in ("prefill", "decode")}
    out |= {f"single {what}": runs for what, runs in res.get("singles", {}).items()}
    return {workload: runs for workload, runs in out.items() if runs}


def summarize(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of every configuration and workload, TTFT ratios to the cold engine's and to the offloading ones'
    (where they ran), tokens to the plain one's."""
    rows = []
    ref = workloads(raw[REFERENCE]) if REFERENCE in raw else None
    for name, res in raw.items():
        for workload, runs in workloads(res).items():
            theirs = ref.get(workload) if ref is not None and name != REFERENCE else None
            rows.append(figures(name, workload, runs, theirs))
    for base in (COLD, OFFLOAD):
        theirs = {r["workload"]: r["ttft_p50_ms"] for r in rows if r["engine"] == base}
        for r in rows:
            if r["workload"] in theirs and theirs[r["workload"]] > 0:
                r[f"ttft_p50_vs_{base}"] = round(r["ttft_p50_ms"] / theirs[r["workload"]], 3)
    return rows


def targets(report: harness.Report) -> None:
    """The goals of the vLLM integration, checked on this run's own figures."""
    cfg = report.config
    by = {(r["engine"], r["workload"]): r for r in report.results}
    for name in cfg["engines"]:
        config = ENGINES[name]
        if config.connector is None:
            continue
        if config.spans_gpus:
            across_gpus(report, name, by)
        else:
            one_gpu(report, name, by)
        if config.resident:
            counters = report.raw[name].get("connector", {}).values()
            copied = [c.get("copied_blocks", 0) for c in counters]
            installed = sum(c.get("installed_blocks", 0) for c in counters)
            if copied:
                report.targets.append(harness.Target(
                    f"{name}: blocks copied between vLLM's cache and the arena", "0", f"{sum(copied)} "
                    f"({installed} installed by id)", sum(copied) == 0))  # fmt: skip


def one_gpu(report: harness.Report, name: str, by: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The goals of a configuration whose two engines share one GPU's arena."""
    cfg = report.config
    alone = [by.get((name, f"single {w}"), {}).get("same_tokens_as_plain") for w in ("B", "P")]
    if all(alone):
        ok = all(a == b for a, b in (x.split("/") for x in alone))  # type: ignore[union-attr]
        report.targets.append(harness.Target(
            f"{name}: greedy tokens one request at a time as vLLM's own cache", "identical",
            f"B {alone[0]}, P {alone[1]}", ok))  # fmt: skip
    burst = by.get((name, "prefix burst"))
    if burst is not None and "ttft_p50_vs_cold" in burst:
        ratio = burst["ttft_p50_vs_cold"]
        own = by.get((REFERENCE, "prefix burst"), {}).get("ttft_p50_vs_cold")
        report.targets.append(harness.Target(
            f"{name}: burst TTFT p50 of a prefix another engine computed / cold", "<= 0.6x", f"{ratio:.2f}x",
            ratio <= 0.6, f"vLLM's own cache {own:.2f}x" if own is not None else ""))  # fmt: skip
    if ENGINES[name].resident:
        for workload in [w for (e, w) in by if e == name and w.startswith("prefix ")]:
            own = by.get((REFERENCE, workload))
            if own is None or not own["ttft_p50_ms"]:
                continue
            ratio = by[(name, workload)]["ttft_p50_ms"] / own["ttft_p50_ms"]
            report.targets.append(harness.Target(
                f"{name}: TTFT p50 of a prefix another engine computed / vLLM's own cache ({workload})",
                "<= 1.1x", f"{ratio:.2f}x", ratio <= 1.1))  # fmt: skip
        sides = report.raw[name].get("connector", {}).values()
        decode = max(sides, key=lambda c: c.get("handovers", 0), default={})
        handover, read = decode.get("handover_p50_us", 0), report.raw.get("nixl", {}).get("read_p50_us")
        if handover and read:
            report.targets.append(harness.Target(
                f"{name}: decode engine's handover p50 (request taken in -> its blocks usable) / a NIXL READ of the "
                "same blocks", "<= 0.1x", f"{handover / read:.3f}x", handover / read <= 0.1,
                f"{handover} us against {read} us; the claim, from the request's arrival in the engine to the "
                f"pool's answer: {decode.get('handover_claim_from_arrival_p50_us', 0)} us"))  # fmt: skip
    if burst is not None and "pool" in burst:
        shared = cfg["requests"] * (cfg["prefix_len"] // cfg["block_size"])
        got = [r["hit_blocks_B"] for r in burst["pool"]]
        report.targets.append(harness.Target(
            f"{name}: each prefix held once (B's shared blocks are A's, found in the pool)", f"{shared} a round",
            ", ".join(map(str, got)), all(g == shared for g in got)))  # fmt: skip


def across_gpus(report: harness.Report, name: str, by: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The goals of a configuration whose writer and reader are on two GPUs, one arena each: B's prefix was
    computed on the other GPU, and reaches the reader's in one batched peer copy a request."""
    cfg = report.config
    alone = by.get((name, "single B"), {}).get("same_tokens_as_plain")
    if alone:
        a, b = alone.split("/")
        report.targets.append(harness.Target(
            f"{name}: greedy tokens one request at a time as vLLM's own cache (prefix computed on the other GPU)",
            "identical", f"B {alone}", a == b))  # fmt: skip
    burst = by.get((name, "prefix burst"))
    offload = by.get((OFFLOAD, "prefix burst"))
    if burst is not None and "ttft_p50_vs_cold" in burst:
        ratio = burst["ttft_p50_vs_cold"]
        theirs = (offload or {}).get("ttft_p50_vs_cold")
        report.targets.append(harness.Target(
            f"{name}: prefix computed on the other GPU: burst TTFT p50 / cold", "<= 0.7x", f"{ratio:.2f}x",
            ratio <= 0.7, f"vLLM's CPU offloading connector {theirs:.2f}x" if theirs is not None else ""))  # fmt: skip
    if burst is not None and "ttft_p50_vs_offload" in burst and offload is not None:
        ratio = burst["ttft_p50_vs_offload"]
        report.targets.append(harness.Target(
            f"{name}: prefix computed on the other GPU: burst TTFT p50 / vLLM's CPU offloading connector", "lower",
            f"{ratio:.2f}x", ratio < 1,
            f"{burst['ttft_p50_ms']:.1f} against {offload['ttft_p50_ms']:.1f} ms"))  # fmt: skip
    if burst is not None and "pool" in burst:
        shared = cfg["requests"] * (cfg["prefix_len"] // cfg["block_size"])
        copied = [r.get("peer_copied_blocks_B", 0) for r in burst["pool"]]
        hits = [r["hit_blocks_B"] for r in burst["pool"]]  # the pool counts the blocks it copied as hits
        copies = [r.get("peer_copies_B", 0) for r in burst["pool"]]
        report.targets.append(harness.Target(
            f"{name}: each prefix copied to the other GPU once (B's shared blocks are A's, copied between arenas)",
            f"{shared} a round", ", ".join(map(str, copied)),
            all(c == shared and h == shared for c, h in zip(copied, hits, strict=True)),
            f"for {', '.join(map(str, copies))} lookups; hits {', '.join(map(str, hits))}"))  # fmt: skip


def body(report: harness.Report) -> str:
    cfg = report.config
    head = (f"vLLM {cfg['vllm']}, {cfg['requests']} prompts x {cfg['prompt_len']} tokens ({cfg['prefix_len']} shared "
            f"by A and B) -> {cfg['new_tokens']} new, {cfg['rounds']} rounds, CUDA graphs "
            f"{'on' if cfg['cuda_graphs'] else 'off'}; TTFT and TPOT in ms")  # fmt: skip
    two = {name: gpus for name, gpus in cfg.get("gpus", {}).items() if len(set(gpus)) > 1}
    if two:
        head += "; on two GPUs (writer, reader): " + ", ".join(f"{n} {w} and {r}" for n, (w, r) in two.items())
    offload = any("ttft_p50_vs_offload" in r for r in report.results)
    rows = [
        [r["engine"], r["workload"], r["n"], f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f}",
         f"{r['tpot_p50_ms']:.2f} / {r['tpot_p99_ms']:.2f}", r.get("ttft_p50_vs_cold", "-"),
         *([r.get("ttft_p50_vs_offload", "-")] if offload else []), f"{r['cached_share']:.0%}",
         r.get("same_tokens_as_plain", "-")]
        for r in report.results
    ]  # fmt: skip
    headers = ["engine", "workload", "n", "TTFT p50 / p99", "TPOT p50 / p99", "/ cold",
               *(["/ offload"] if offload else []), "cached", "same as plain"]  # fmt: skip
    return head + "\n" + harness.table(headers, rows)


def memory_body(report: harness.Report) -> str:
    mem = report.raw["memory"]
    cfg = report.config
    head = (f"vLLM {cfg['vllm']}, {mem['system_prompts']} system prompts of {cfg['prompt_len']} tokens "
            f"({mem['system_prompt_blocks']} blocks) on two engines: one arena of {cfg['pool_blocks']} blocks, or two "
            f"caches of {cfg['pool_blocks'] // 2}; the second half of {cfg['memory_requests']} requests")  # fmt: skip
    rows = [[r["engine"], r["n"], f"{r['cached_share']:.0%}", f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f}"]
            for r in report.results]  # fmt: skip
    return head + "\n" + harness.table(["engines", "n", "cached", "TTFT p50 / p99"], rows)


def plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    kinds = list(dict.fromkeys(r["workload"] for r in report.results))
    engines = list(dict.fromkeys(r["engine"] for r in report.results))
    width = 0.8 / max(1, len(engines))
    for i, name in enumerate(engines):
        rows = {r["workload"]: r for r in report.results if r["engine"] == name}
        xs = [k + i * width for k in range(len(kinds))]
        p50 = [rows[w]["ttft_p50_ms"] if w in rows else 0 for w in kinds]
        p99 = [rows[w]["ttft_p99_ms"] if w in rows else 0 for w in kinds]
        ax.bar(xs, p50, width, label=f"{name} p50")
        ax.scatter(xs, p99, marker="_", s=200, color="black", zorder=3)
    ax.set_xticks([k + width * (len(engines) - 1) / 2 for k in range(len(kinds))], kinds)
    ax.set(ylabel="TTFT ms (bar p50, tick p99)", title="vLLM engines with and without the kvpool connector")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"kvpool vllm ({machine.describe_device(machine.device_info(report.device))})")
    return fig


# -- the suite ------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    device = machine.resolve_device(args)
    if not device.is_cuda:
        raise SystemExit("kvpool bench vllm: needs a CUDA GPU (vLLM's engines run there); --device cpu cannot run it")
    import torch

    args.engines = chosen(args.engines, device.index, torch.cuda.device_count())
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        raise SystemExit(
            "kvpool bench vllm: each engine's core runs in a process of its own on its GPU: unset "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    cfg = config_of(args) | {"vllm": require_vllm()}
    used = sorted({gpu for gpus in cfg["gpus"].values() for gpu in gpus})
    cfg["gpu_names"] = {str(gpu): torch.cuda.get_device_name(gpu) for gpu in used}  # the report's device: the first
    model = args.model
    if model is None:
        model = args.work / "llama-1b-random"
        if not (model / "config.json").exists():
            build_model(model)
    cfg |= {"model": str(model), "model_config": json.loads((model / "config.json").read_text())}
    if cfg["offload_bytes"] is None:  # as large as each offload engine's GPU cache
        cfg["offload_bytes"] = cfg["pool_blocks"] * pool_layout(cfg["model_config"], cfg["block_size"]).block_nbytes
    report = harness.Report("vllm", args, device, cfg)
    if args.memory:
        cfg["memory_requests"] = args.memory_requests
        report.raw = {"memory": memory(cfg, model, device, args.memory_requests)}
        report.results = [{"engine": k, **v} for k, v in report.raw["memory"].items() if isinstance(v, dict)]
        mem = report.raw["memory"]
        report.targets.append(harness.Target(
            "resident: prompt tokens not computed, many system prompts, against private caches of the same memory",
            "higher", f"{mem['resident']['cached_share']:.0%} against {mem['private']['cached_share']:.0%}",
            mem["resident"]["cached_share"] > mem["private"]["cached_share"],
            f"TTFT p50 {mem['resident']['ttft_p50_ms']} against {mem['private']['ttft_p50_ms']} ms"))  # fmt: skip
        report.print_block("vllm", memory_body(report))
        report.save(lambda: None)
        return 0
    report.raw = measure(args, cfg, model, device)
    if any(ENGINES[n].connector is not None and ENGINES[n].pairs for n in cfg["engines"]):  # the pair's baseline
        layout = pool_layout(cfg["model_config"], cfg["block_size"])
        page = layout.block_nbytes // layout.num_layers  # one layer's K and V of a block: one NIXL descriptor
        report.raw["nixl"] = nixl.read_requests(layout.num_layers, cfg["prompt_len"] // cfg["block_size"], page,
                                                max(4, cfg["requests"]))  # fmt: skip
    report.results = summarize({k: v for k, v in report.raw.items() if k in ENGINES})
    for name in cfg["engines"]:
        report.config.setdefault("start_s", {})[name] = report.raw[name]["start_s"]
    targets(report)
    if cfg["rounds"] < 3:
        report.notes.append("a burst's TTFT moves with how vLLM splits it into steps: few rounds make a rough p50")
    report.print_block("vllm", body(report))
    report.save(lambda: plot(report))
    return 0
