"""Connector variants on one GPU, same run: the second engine's TTFT with each, against the same plain engine.

    python -m kvpool.benchmarks.vllm_variants --out results/ [--baseline-module kvpool_vllm_base]

The prefix-sharing workload of :mod:`.vllm_engines` (32 x 1024-token prompts, 768 shared with a prompt engine 1
computed; 64 new tokens; greedy; eager). A plain engine gives B cold and B on its own prefix cache (twice, to see
how far vLLM's batched runs agree with themselves); then engine 1 (the connector, this revision) computes A and
engine 2 serves B once per variant, a fresh engine each. ``--baseline-module`` names a copy of another revision's
connector package, loaded by vLLM as the first variant (before/after in one run). Each variant's connector profile
(where its time went) is read back. ``--batch-invariant`` repeats the token comparison with vLLM's batch-invariant
kernels (``VLLM_BATCH_INVARIANT=1``): it tells differences of batch composition from differences of KV.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.benchmarks.vllm_engines import BS, build_model, close, engine, p50, prompts, run
from kvpool.client import PoolClient
from kvpool.server.launch import spawn

NEW_MODULE = "kvpool.integrations.vllm"


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def first_diff(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """For each request whose tokens differ, the index of the first token that differs."""
    pairs = [(p, q) for p, q in zip(a, b, strict=True) if p != q]
    return [next(i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y) for p, q in pairs]


def plain(model: Path, seeds: list[int]) -> dict[str, Any]:
    llm = engine(model, None, 0.3)
    warm = prompts(999)
    run(llm, warm["A"]), run(llm, warm["B"])
    res: dict[str, Any] = {"B_cold": [], "B_own": [], "B_own_again": []}
    for s in seeds:
        ps = prompts(s)
        llm.reset_prefix_cache()
        res["B_cold"].append(run(llm, ps["B"]))
        for key in ("B_own", "B_own_again"):
            llm.reset_prefix_cache()
            run(llm, ps["A"])
            res[key].append(run(llm, ps["B"]))
    close(llm)
    return res


def profile_of(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(directory.glob("*.json")):
        out[f.stem.split("-")[0]] = json.loads(f.read_text())
    return out


def pooled(
    model: Path, url: str, variants: list[tuple[str, str, dict, int]], out_dir: Path, rounds: int
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with PoolClient(url, name="bench") as probe:
        e1 = engine(model, url, 0.2)
        run(e1, prompts(998)["A"])
        for name, module, extra, seed0 in variants:
            pdir = out_dir / name
            pdir.mkdir(parents=True, exist_ok=True)
            if module == NEW_MODULE:
                extra = {"profile_dir": str(pdir), **extra}
            t = time.perf_counter()
            e2 = engine(model, url, 0.2, extra, module)
            started = time.perf_counter() - t
            run(e2, prompts(998)["B"])
            runs, counters = [], []
            for r in range(rounds):
                ps = prompts(seed0 + r)
                run(e1, ps["A"])
                c0 = probe.stats()["counters"]
                runs.append(run(e2, ps["B"]))
                c1 = probe.stats()["counters"]
                counters.append({k: c1[k] - c0[k] for k in ("hit_blocks", "committed_blocks")})
            close(e2)
            res[name] = {"runs": runs, "pool": counters, "start_s": round(started, 1), "profile": profile_of(pdir)}
            print(f"{name}: B TTFT p50 {p50([x for r in runs for x in r['ttft_ms']])} ms {counters}", flush=True)
        close(e1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-module", help="a copy of another revision's connector package, run first")
    ap.add_argument(
        "--batch-invariant",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="repeat the token comparison with vLLM's batch-invariant kernels, this many rounds",
    )
    ap.add_argument("--no-plain", action="store_true", help="only the pool's variants (no cold or own-cache figures)")
    ap.add_argument("--variants", nargs="*", default=["new_one_lookup_lane", "new_no_layerwise"],
                    help="settings tried besides this revision's defaults")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvp-vllm-"))
    model = work / "llama-1b-random"
    build_model(model)
    variants = [("new", NEW_MODULE, {}, 0), ("new_one_lookup_lane", NEW_MODULE, {"lookup_threads": 1}, 200),
                ("new_no_layerwise", NEW_MODULE, {"layerwise": False}, 300)]  # fmt: skip
    variants = [v for v in variants if v[0] == "new" or v[0] in args.variants]
    if args.baseline_module:
        variants.insert(0, ("baseline", args.baseline_module, {}, 100))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}

    def save() -> None:
        (args.out / "raw.json").write_text(json.dumps(out))

    def phase(tag: str, rounds: int) -> None:
        sock = work / f"kvpool-{tag}.sock"
        flags = ["--socket", str(sock), "--port", "0", "--backend", "cuda", "--num-blocks", "20480",
                 "--num-layers", "16", "--num-kv-heads", "8", "--head-dim", "64", "--block-size", str(BS),
                 "--dtype", "bf16", "--model", str(model), "--log-level", "warning"]  # fmt: skip
        if not args.no_plain:
            out[f"plain{tag}"] = plain(model, list(range(rounds)))
            save()
        pool = spawn(["kvpool", "serve", *flags], socket=sock, port=0, log=args.out / f"pool{tag}.log", timeout_s=120)
        try:
            vs = variants if not tag else [v for v in variants if v[0] == "new"]
            out[f"pool{tag}"] = pooled(model, f"unix://{sock}", vs, args.out / f"profiles{tag}", rounds)
        finally:
            pool.stop()
        save()
        print(json.dumps(summary(out, tag), indent=1), flush=True)

    phase("", args.rounds)
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by the engines started from here on
        try:
            phase("_bi", args.batch_invariant)
        except Exception as exc:  # the figures of the first phase stand on their own
            out["batch_invariant_error"] = f"{type(exc).__name__}: {exc}"
            save()
            print(f"batch-invariant phase failed: {out['batch_invariant_error']}", flush=True)
    (args.out / "summary.json").write_text(json.dumps({t: summary(out, t) for t in ("", "_bi") if f"pool{t}" in out}))


def summary(out: dict, tag: str) -> dict[str, Any]:
    po = out[f"pool{tag}"]
    cat = lambda runs, f: [x for r in runs for x in r[f]]  # noqa: E731
    if f"plain{tag}" not in out:
        return {name: {"ttft_p50_ms": p50(cat(v["runs"], "ttft_ms")), "tpot_p50_ms": p50(cat(v["runs"], "tpot_ms")),
                       "pool": v["pool"], "profile": v["profile"]} for name, v in po.items()}  # fmt: skip
    pl = out[f"plain{tag}"]
    toks = lambda runs: [t for r in runs for t in r["tokens"]]  # noqa: E731
    cold = p50(cat(pl["B_cold"], "ttft_ms"))
    s: dict[str, Any] = {
        "ttft_p50_ms": {
            "B_cold": cold,
            "B_own_cache": p50(cat(pl["B_own"], "ttft_ms")),
            "B_own_cache_again": p50(cat(pl["B_own_again"], "ttft_ms")),
        },
        "tpot_p50_ms_cold": p50(cat(pl["B_cold"], "tpot_ms")),
        "identical": {
            "own_vs_own_again": agree(toks(pl["B_own"]), toks(pl["B_own_again"])),
            "own_vs_cold": agree(toks(pl["B_own"]), toks(pl["B_cold"])),
        },
    }
    for name, v in po.items():
        ttft = p50(cat(v["runs"], "ttft_ms"))
        s["ttft_p50_ms"][name] = ttft
        s[f"ratio_{name}_vs_cold"] = round(ttft / cold, 3)
        s[f"tpot_p50_ms_{name}"] = p50(cat(v["runs"], "tpot_ms"))
        s[f"pool_{name}"] = v["pool"]
        s[f"profile_{name}"] = v["profile"]
        if name == "new":
            s["identical"]["pool_vs_own"] = agree(toks(v["runs"]), toks(pl["B_own"]))
            s["identical"]["pool_vs_own_again"] = agree(toks(v["runs"]), toks(pl["B_own_again"]))
            s["first_diff_pool_vs_own"] = first_diff(toks(v["runs"]), toks(pl["B_own"]))
            s["first_diff_own_vs_own_again"] = first_diff(toks(pl["B_own"]), toks(pl["B_own_again"]))
    return s


if __name__ == "__main__":
    main()
