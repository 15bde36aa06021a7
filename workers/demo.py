"""``kvpool demo``: the whole flow on one machine, checked against a monolithic run of the same model.

It starts a pool, one prefill and one decode worker, each its own process (``python -m ...``), sends a handful of
prompts (some sharing a prefix, one repeated), prints each request's generated tokens, prefix-cache hits and
timings, then runs the same prompts through :func:`workers.monolithic.greedy_generate` in this process and exits
non-zero if any token differs. With no flags it uses a tiny seeded random model and runs on the CPU in seconds;
it says what it is doing as it goes (the pool up, the workers up, each request done), a line at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpool.client import http_client
from kvpool.commands import Parser
from kvpool.layout import KVLayout
from kvpool.server.arenas import resolve_backend
from kvpool.server.launch import ServerProcess, child_env, spawn
from kvpool.workers.cli import TINY
from kvpool.workers.kvcache import layout_for
from kvpool.workers.model import LlamaConfig, LlamaModel
from kvpool.workers.monolithic import greedy_generate
from kvpool.workers.request import GenerationRequest


def start_pool(
    layout: KVLayout,
    num_blocks: int,
    workdir: Path,
    backend: str,
    model_name: str,
    timeout_s: float = 60.0,
    extra: Sequence[str] = (),
) -> ServerProcess:
    """``kvpool serve`` on a Unix socket in ``workdir`` (no TCP port), ready when ``/health`` answers 200."""
    sock = workdir / "kvpool.sock"
    args = [
        "kvpool", "serve", "--socket", str(sock), "--port", "0",
        "--num-blocks", str(num_blocks), "--num-layers", str(layout.num_layers),
        "--num-kv-heads", str(layout.num_kv_heads), "--head-dim", str(layout.head_dim),
        "--block-size", str(layout.block_size), "--dtype", layout.dtype, "--order", layout.order,
        "--backend", backend, "--model", model_name, "--log-level", "warning", *extra,
    ]  # fmt: skip
    return spawn(args, socket=sock, port=0, log=workdir / "pool.log", timeout_s=timeout_s)


@dataclass
class FlowResult:
    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    wall_s: float

    def tokens(self) -> dict[str, list[int]]:
        return {r["request_id"]: r.get("tokens", []) for r in self.decode}


@dataclass
class _Tail:
    """The JSON lines a worker has written to its output file so far, read as they come."""

    path: Path
    offset: int = 0
    partial: bytes = field(default=b"")

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def _sessions(url: str) -> int:
    try:
        with http_client(url, None, 2.0) as http:
            return int(http.get("/stats").json().get("sessions", 0))
    except Exception:  # the pool busy or not answering this instant: the next look tells
        return 0


def _progress_line(kind: str, record: dict[str, Any]) -> str:
    rid = record.get("request_id", "?")
    if "error" in record:
        return f"{rid}: {kind} failed: {record['error']}"
    if kind == "prefill":
        return (f"{rid} prefilled: {record.get('prompt_len')} prompt tokens, {record.get('hit_tokens') or 0} from "
                "the prefix cache, handed to the decode worker")  # fmt: skip
    per = record.get("ms_per_token")
    return f"{rid} done: {len(record.get('tokens') or [])} tokens" + (f", {per:.2f} ms per token" if per else "")


def _run(cmd: list[str], workdir: Path, name: str) -> subprocess.Popen[bytes]:
    """Start a worker; its JSON lines go to ``<name>.out``, its log to ``<name>.log`` (files: no pipe to fill)."""
    with (workdir / f"{name}.out").open("wb") as out, (workdir / f"{name}.log").open("wb") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())


#: sequences per decode step, the same in the decode worker and the reference (a batch-invariant step's shape)
DEMO_MAX_BATCH = 32
#: the demo's decode worker, to which its prefill addresses every handoff
DECODE_NAME = "decode-0"


def run_workers(
    url: str,
    model_args: Sequence[str],
    requests: Sequence[GenerationRequest],
    workdir: Path,
    timeout_s: float = 120.0,
    decode_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> FlowResult:
    """Run one prefill and one decode worker process against the pool at ``url`` over ``requests``; ``progress``
    hears when both are connected to the pool and each request as a worker finishes its part."""
    req_file = workdir / "requests.jsonl"
    req_file.write_text("".join(r.to_json() + "\n" for r in requests))
    threads = max(1, (os.cpu_count() or 2) // 2)
    base = ["--pool", url, "--threads", str(threads), *model_args]
    t0 = time.perf_counter()
    decode = _run(
        [sys.executable, "-m", "kvpool.workers.decode", *base, "--name", DECODE_NAME,
         "--num-requests", str(len(requests)), *decode_args],
        workdir,
        "decode",
    )  # fmt: skip
    prefill = _run(
        [sys.executable, "-m", "kvpool.workers.prefill", *base, "--handoff-to", DECODE_NAME,
         "--requests", str(req_file), *prefill_args],
        workdir,
        "prefill",
    )  # fmt: skip
    tails = {name: _Tail(workdir / f"{name}.out") for name in ("prefill", "decode")}
    up = progress is None

    def watch() -> None:
        nonlocal up
        done = [(name, record) for name, tail in tails.items() for record in tail.new()]
        # a request done means both were up, even where a busy machine let the prefill end between two looks
        if not up and (done or _sessions(url) >= 2):
            up = True
            assert progress is not None
            progress(f"workers up: prefill and decode connected to the pool ({time.perf_counter() - t0:.1f} s)")
        for name, record in done:
            if progress is not None:
                progress(_progress_line(name, record))

    try:
        while prefill.poll() is None or decode.poll() is None:
            watch()
            if prefill.poll() is not None:
                _check_exit(prefill, workdir, "prefill")  # a failed request would leave the decode waiting for it
            if decode.poll() is not None:
                _check_exit(decode, workdir, "decode")
            if time.perf_counter() - t0 > timeout_s:
                raise subprocess.TimeoutExpired(decode.args, timeout_s)
            time.sleep(0.05)
        _check_exit(prefill, workdir, "prefill")
        _check_exit(decode, workdir, "decode")
        watch()
    finally:
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    return FlowResult(_lines(workdir / "prefill.out"), _lines(workdir / "decode.out"), wall)


def _check_exit(proc: subprocess.Popen[bytes], workdir: Path, name: str) -> None:
    if proc.returncode != 0:
        out = (workdir / f"{name}.out").read_text(errors="replace")
        log = (workdir / f"{name}.log").read_text(errors="replace")
        raise RuntimeError(f"the {name} worker exited with {proc.returncode}:\n{out[-2000:]}{log[-4000:]}")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def demo_prompts(vocab_size: int, block_size: int, max_new_tokens: int, seed: int = 0) -> list[GenerationRequest]:
    """Six prompts: three share a three-block system prefix, one repeats an earlier prompt, two stand alone."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    system = toks(3 * block_size + 5)
    prompts = [
        system + toks(9),
        toks(2 * block_size + 3),
        system + toks(block_size + 1),
        system + toks(4),
        toks(7),
    ]
    prompts.append(list(prompts[1]))
    return [GenerationRequest(f"req-{i}", p, max_new_tokens) for i, p in enumerate(prompts)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(prog="kvpool demo", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, default=None, help="local HF-format checkpoint (default: tiny random)")
    which.add_argument("--random-model", action="store_true", help="a tiny seeded random model (the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--order", choices=["layer_major", "block_major"], default="layer_major")
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--devices",
        default=None,
        metavar="P,D",
        help="prefill on device P, decode on device D, one pool arena each (KV moves between them by block ids)",
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the workers and the reference in fixed-shape forwards, so that tokens match to the bit in any "
        "dtype (the default; without it, bf16 may flip a near-tied token)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON summary instead of the table")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout is the summary's alone

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    backend = resolve_backend(args.backend)
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    if args.model is not None:
        config = LlamaConfig.from_dir(args.model)
        model_args = ["--model", str(args.model)]
        name = args.model.resolve().name
    else:
        config = TINY
        model_args = ["--random-model", "--seed", str(args.seed)]
        name = f"random-tiny-seed{args.seed}"
    layout = layout_for(config, args.block_size, args.dtype, args.order)
    if args.batch_invariant:
        model_args.append("--batch-invariant")
    requests = demo_prompts(config.vocab_size, args.block_size, args.max_new_tokens, args.seed)

    workdir = Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
    try:
        t0 = time.perf_counter()
        placement: dict[str, list[str]] = {"extra": [], "prefill_args": [], "decode_args": []}
        if args.devices:
            p_dev, d_dev = args.devices.split(",")
            placement = {
                "extra": ["--devices", args.devices],
                "prefill_args": ["--device", p_dev],
                "decode_args": ["--device", d_dev],
            }
        say(f"kvpool demo: starting a pool ({backend} arena), then a prefill and a decode worker, each its own process")
        pool = start_pool(layout, args.num_blocks, workdir, backend, name, extra=placement["extra"])
        pool_s = time.perf_counter() - t0
        say(f"pool up: {args.num_blocks} blocks of {layout.block_size} tokens ({pool_s:.1f} s)")
        try:
            flow = run_workers(
                pool.url,
                model_args,
                requests,
                workdir,
                args.timeout_s,
                decode_args=[*placement["decode_args"], "--max-batch", str(DEMO_MAX_BATCH)],
                prefill_args=placement["prefill_args"],
                progress=say,
            )
            with http_client(pool.url, None, 5.0) as http:
                stats = http.get("/stats").json()
        finally:
            pool.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    dtype = getattr(torch, args.dtype)
    model = (
        LlamaModel.from_pretrained(args.model, device, dtype)
        if args.model is not None
        else LlamaModel.random(config, args.seed, device, dtype)
    )
    model.batch_invariant = args.batch_invariant
    say(f"checking: the same {len(requests)} prompts through one monolithic generator in this process")
    t1 = time.perf_counter()
    expected = greedy_generate(model, [r.prompt for r in requests], args.max_new_tokens, layout, DEMO_MAX_BATCH)
    mono_s = time.perf_counter() - t1
    got = flow.tokens()
    mismatched = [r.request_id for r, want in zip(requests, expected, strict=True) if got.get(r.request_id) != want]
    summary = _summary(requests, flow, expected, stats, pool_s, mono_s, backend)
    summary["batch_invariant"] = args.batch_invariant
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
    if mismatched:
        print(f"MISMATCH: disaggregated output differs from the monolithic run for {mismatched}", file=sys.stderr)
        return 1
    return 0


def _summary(
    requests: Sequence[GenerationRequest],
    flow: FlowResult,
    expected: list[list[int]],
    stats: dict[str, Any],
    pool_s: float,
    mono_s: float,
    backend: str,
) -> dict[str, Any]:
    prefill = {r["request_id"]: r for r in flow.prefill}
    decode = {r["request_id"]: r for r in flow.decode}
    rows = []
    for req, want in zip(requests, expected, strict=True):
        p, d = prefill.get(req.request_id, {}), decode.get(req.request_id, {})
        rows.append({
            "request_id": req.request_id,
            "prompt_len": len(req.prompt),
            "hit_tokens": p.get("hit_tokens"),
            "computed_tokens": p.get("computed_tokens"),
            "prefill_ms": p.get("forward_ms"),
            "ms_per_token": d.get("ms_per_token"),
            "e2e_ms": d.get("e2e_ms"),
            "tokens": d.get("tokens"),
            "match": d.get("tokens") == want,
            "direct": d.get("direct"),
            "error": p.get("error") or d.get("error"),
        })  # fmt: skip
    generated = sum(len(r["tokens"] or []) for r in rows)
    return {
        "backend": backend,
        "requests": rows,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "hit_tokens": sum(r["hit_tokens"] or 0 for r in rows),
        "computed_tokens": sum(r["computed_tokens"] or 0 for r in rows),
        "generated_tokens": generated,
        "pool_start_s": round(pool_s, 3),
        "workers_wall_s": round(flow.wall_s, 3),
        "monolithic_s": round(mono_s, 3),
        "pool_hit_rate": stats.get("hit_rate"),
        "handoffs_direct": sum(bool(r["direct"]) for r in rows),
        "blocks_in_use_after": stats.get("in_use"),
        "all_match": all(r["match"] for r in rows),
    }


def _print_table(s: dict[str, Any]) -> None:
    print(f"kvpool demo ({s['backend']}): 1 pool + 1 prefill worker + 1 decode worker, separate processes")
    print(f"{'request':<8} {'prompt':>6} {'hit':>4} {'computed':>8} {'prefill ms':>10} {'ms/tok':>7}  "
          f"{'as monolithic':<13}  first tokens")  # fmt: skip
    for r in s["requests"]:
        shown = (r["tokens"] or [])[:8]
        toks = "[" + ", ".join(map(str, shown)) + (", ...]" if len(r["tokens"] or []) > 8 else "]")
        same = "same" if r["match"] else "DIFFERENT"
        print(
            f"{r['request_id']:<8} {r['prompt_len']:>6} {r['hit_tokens'] or 0:>4} {r['computed_tokens'] or 0:>8} "
            f"{r['prefill_ms'] or 0:>10.2f} {r['ms_per_token'] or 0:>7.2f}  {same:<13}  "
            f"{toks}{'  ' + r['error'] if r['error'] else ''}"
        )
    print(
        f"prompt tokens {s['prompt_tokens']}: {s['hit_tokens']} from the prefix cache, {s['computed_tokens']} "
        f"computed; {s['generated_tokens']} generated"
    )
    print(
        f"handoffs: {s['handoffs_direct']} of {len(s['requests'])} delivered straight to the decode worker's inbox "
        "(the rest reached it through the pool, while it waited there idle)"
    )
    print(
        f"pool start {s['pool_start_s']:.2f} s, workers {s['workers_wall_s']:.2f} s (process start included), "
        f"monolithic {s['monolithic_s']:.2f} s; blocks in use after: {s['blocks_in_use_after']}"
    )
    print("disaggregated == monolithic: " + ("yes" if s["all_match"] else "NO"))


if __name__ == "__main__":
    raise SystemExit(main())
