"""vLLM engines with CUDA graphs on one GPU: TTFT through the pool for a burst and at a steady arrival rate, greedy
tokens, and the prefill/decode pair through kvpool against the same pair through vLLM's NixlConnector.

    python -m kvpool.benchmarks.vllm_graphs --out results/ [--phases pool nixl plain] [--rates 8 16]

The workload of :mod:`.vllm_engines` (a Llama-3.2-1B-shaped random model in bf16, 32 x 1024-token prompts -> 64
new, greedy, TRITON_ATTN; prompt B shares a 768-token prefix with prompt A, P are unrelated prompts), with CUDA
graphs on, as users run vLLM (the connector's layer-wise loads make its engines use piecewise graphs). Each phase
runs in this process and is saved to ``<phase>.json`` in ``--out`` when it ends; the model is kept in ``--work``,
so a later call with the phases still missing completes a run that was cut short. The summary reads all of them.

- ``pool``: one pool, engines 1 and 2 with the connector. The pair: P prefilled on engine 1 (1 token, parked),
  decoded on engine 2 (claimed), in batches of 32 and one request at a time. Prefix sharing: A on engine 1, then
  B on engine 2, all 32 at t0 (a burst) and at each steady rate; B one at a time for the tokens.
- ``nixl``: the same pair through vLLM's NixlConnector (a producer and a consumer engine, reads over CUDA IPC).
- ``plain``: one engine without a connector: B cold and on vLLM's own prefix cache (burst and steady), P cold and
  on its own cache, one request at a time for the tokens.
- ``plain_stamped``: the same engine and workload with the connector attached but passive (``load`` and ``save``
  off), for its timeline: where vLLM's own cache spends a burst's steps, stamped as the pool phases are.
- ``plain_passive``: the same without the stamps (no ``profile_dir``): what the connector's presence alone costs.
- ``pool_quiet``: ``pool_flat`` without the connector's profile and timeline, as users run it (no figures of the
  connector's own, vLLM's stamps only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.benchmarks.vllm_drive import (
    nixl_metrics,
    nixl_prefill_params,
    nixl_transfer,
    per_transfer,
    profile_delta,
    read_profiles,
    run_steady,
    settle,
)
from kvpool.benchmarks.vllm_engines import BS, N_REQ, PROMPT, SINGLES, build_model, close, engine, prompts, run
from kvpool.benchmarks.vllm_graphs_report import passive, summary
from kvpool.client import PoolClient
from kvpool.server.launch import spawn

PARK = {"do_remote_decode": True}
#: the plain engine's workload with the connector attached, loading and saving nothing: stamped, and not
PASSIVE = ("plain_stamped", "plain_passive")
#: the connector's settings per pool phase: its defaults, loads before the forward (no per-layer hook, so vLLM
#: may capture full CUDA graphs), and variants of that (two lookup lanes, a short GIL switch interval, lookups
#: started when the scheduler takes a request in rather than on arrival, a 1 ms wait for lookups, the first
#: arrival on an idle engine looked up on vLLM's input thread)
POOL_VARIANTS: dict[str, dict[str, Any]] = {
    "pool": {},
    "pool_flat": {"layerwise": False},
    "pool_lanes2": {"layerwise": False, "lookup_threads": 2},
    "pool_switch": {"layerwise": False, "switch_interval_ms": 0.2},
    "pool_switch1": {"layerwise": False, "switch_interval_ms": 1.0},
    "pool_late": {"layerwise": False, "early_lookup": False},
    "pool_wait1": {"layerwise": False, "lookup_wait_ms": 1.0},
    "pool_inline": {"layerwise": False, "inline_when_idle": True},
    "pool_quiet": {"layerwise": False},
}
#: pool phases whose engines run without ``profile_dir``: nothing of the connector's is timed or written
UNSTAMPED = frozenset({"pool_quiet"})


def steady_seeds(rates: list[float], rounds: int) -> list[tuple[float, int]]:
    return [(rate, 100 + 10 * k + r) for k, rate in enumerate(rates) for r in range(rounds)]


def wait_commits(probe: PoolClient, before: int, n: int, timeout_s: float = 5.0) -> None:
    """Until engine 1's saver committed ``n`` more blocks: B is to find A's prefix in the pool, as it would long
    after A in a server."""
    end = time.monotonic() + timeout_s
    while probe.stats()["counters"]["committed_blocks"] < before + n and time.monotonic() < end:
        time.sleep(0.01)


def started(make: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    llm = make()
    return llm, round(time.perf_counter() - t, 1)


def keep_timelines(profiles: Path, out: Path) -> None:
    """The connector's timelines of a phase's engines into ``out/timelines`` (``vllm_timeline`` reads them there)."""
    keep = out / "timelines"
    keep.mkdir(exist_ok=True)
    for f in profiles.glob("*/timeline-*.jsonl"):
        shutil.copy(f, keep / f"{f.parent.name}-{f.name}")


def pool_phase(
    model: Path, url: str, args: argparse.Namespace, extra: dict[str, Any], stamps: bool = True
) -> dict[str, Any]:
    res: dict[str, Any] = {"pair": [], "burst": [], "steady": [], "single": {"B": [], "P": [], "P_ttft_ms": []},
                           "settings": extra, "stamps": stamps}  # fmt: skip
    pdir = args.work / f"profiles-{time.time_ns()}"

    def settings(name: str) -> dict[str, Any]:
        return {"profile_dir": str(pdir / name), **extra} if stamps else dict(extra)

    with PoolClient(url, name="bench") as probe:
        e1, res["start_s_e1"] = started(lambda: engine(model, url, 0.2, settings("e1"), eager=False))
        e2, res["start_s_e2"] = started(lambda: engine(model, url, 0.2, settings("e2"), eager=False))
        warm = prompts(998)
        run(e1, warm["A"]), run(e2, warm["B"])
        pre = run(e1, warm["P"], max_tokens=1, params=[PARK] * N_REQ)
        run(e2, warm["P"], params=pre["kv_transfer_params"])
        settle(e2)
        p0 = read_profiles(pdir / "e2")
        for r in range(args.rounds):
            ps = prompts(r)
            pre = run(e1, ps["P"], max_tokens=1, params=[PARK] * N_REQ)
            res["pair"].append({"prefill": pre, "decode": run(e2, ps["P"], params=pre["kv_transfer_params"])})
        settle(e2)
        p1 = read_profiles(pdir / "e2")
        res["pair_profile"] = profile_delta(p0, p1)
        print(f"pool pair done: {res['pair_profile']}", flush=True)
        full = N_REQ * (PROMPT // BS)
        for r in range(args.rounds):
            ps = prompts(r)
            c0 = probe.stats()["counters"]
            run(e1, ps["A"])
            wait_commits(probe, c0["committed_blocks"], full)
            c1 = probe.stats()["counters"]
            b = run(e2, ps["B"])
            c2 = probe.stats()["counters"]
            b["pool"] = {"committed_by_A": c1["committed_blocks"] - c0["committed_blocks"],
                         "committed_by_B": c2["committed_blocks"] - c1["committed_blocks"],
                         "hit_blocks_B": c2["hit_blocks"] - c1["hit_blocks"]}  # fmt: skip
            res["burst"].append(b)
        for rate, seed in steady_seeds(args.rates, args.steady_rounds):
            ps = prompts(seed)
            c0 = probe.stats()["counters"]["committed_blocks"]
            run(e1, ps["A"])
            wait_commits(probe, c0, full)
            res["steady"].append({"rate": rate, **run_steady(e2, ps["B"], rate, 64)})
        settle(e2)
        res["ttft_profile"] = profile_delta(p1, read_profiles(pdir / "e2"))
        singles = prompts(500)
        for i in range(SINGLES):
            c0 = probe.stats()["counters"]["committed_blocks"]
            run(e1, singles["A"][i : i + 1])
            wait_commits(probe, c0, PROMPT // BS)
            res["single"]["B"].append(run(e2, singles["B"][i : i + 1])["tokens"][0])
            pre = run(e1, singles["P"][i : i + 1], max_tokens=1, params=[PARK])
            dec = run(e2, singles["P"][i : i + 1], params=pre["kv_transfer_params"])
            res["single"]["P"].append(dec["tokens"][0])
            res["single"]["P_ttft_ms"] += dec["ttft_ms"]
        res["pool_stats"] = probe.stats()
        close(e1)
        close(e2)
    keep_timelines(pdir, args.out)
    return res


def nixl_phase(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"pair": [], "single": {"P": [], "P_ttft_ms": [], "P_producer_own": []}}
    prod, res["start_s_producer"] = started(lambda: engine(model, None, 0.2, eager=False, transfer=nixl_transfer(5600)))
    cons, res["start_s_consumer"] = started(lambda: engine(model, None, 0.2, eager=False, transfer=nixl_transfer(5620)))
    warm = prompts(998)
    pre = run(prod, warm["P"], max_tokens=1, params=[nixl_prefill_params()] * N_REQ)
    res["warm_params"] = pre["kv_transfer_params"][:1]
    run(cons, warm["P"], params=pre["kv_transfer_params"])
    m0 = nixl_metrics(cons)
    for r in range(args.rounds):
        ps = prompts(r)
        pre = run(prod, ps["P"], max_tokens=1, params=[nixl_prefill_params()] * N_REQ)
        res["pair"].append({"prefill": pre, "decode": run(cons, ps["P"], params=pre["kv_transfer_params"])})
    res["metrics_before"], res["metrics_after"] = m0, nixl_metrics(cons)
    res["per_transfer"] = per_transfer(m0, res["metrics_after"])
    print(f"nixl pair done: {res['per_transfer']}", flush=True)
    singles = prompts(500)
    for i in range(SINGLES):
        pre = run(prod, singles["P"][i : i + 1], max_tokens=1, params=[nixl_prefill_params()])
        dec = run(cons, singles["P"][i : i + 1], params=pre["kv_transfer_params"])
        res["single"]["P"].append(dec["tokens"][0])
        res["single"]["P_ttft_ms"] += dec["ttft_ms"]
        # the same KV layout's own answer (NIXL switches the engines to HND): P on the producer's own cache
        res["single"]["P_producer_own"].append(run(prod, singles["P"][i : i + 1])["tokens"][0])
    close(prod)
    close(cons)
    return res


def plain_phase(
    model: Path, args: argparse.Namespace, pool_url: str | None = None, stamps: bool = False
) -> dict[str, Any]:
    """With ``pool_url`` (a pool's URL), the connector rides along loading and saving nothing; with ``stamps``, it
    stamps the engine's steps."""
    res: dict[str, Any] = {"burst": [], "steady": [], "P": [],
                           "single": {"B": [], "B_cold": [], "P": [], "P_ttft_ms": []}}  # fmt: skip
    pdir = args.work / f"profiles-{time.time_ns()}"
    extra = {"load": False, "save": False, **({"profile_dir": str(pdir / "e2")} if stamps else {})}
    llm, res["start_s"] = started(lambda: engine(model, pool_url, 0.3, extra if pool_url else None, eager=False))
    warm = prompts(999)
    run(llm, warm["A"]), run(llm, warm["B"])
    llm.reset_prefix_cache()
    run(llm, warm["B"])  # a cold burst after a reset too: the first one measured took 0.7 s once without it
    for r in range(args.rounds):
        ps = prompts(r)
        llm.reset_prefix_cache()
        cold = run(llm, ps["B"])
        llm.reset_prefix_cache()
        run(llm, ps["A"])
        res["burst"].append({"cold": cold, "own": run(llm, ps["B"])})
        llm.reset_prefix_cache()
        run(llm, ps["P"], max_tokens=1)
        res["P"].append(run(llm, ps["P"]))
    for rate, seed in steady_seeds(args.rates, args.steady_rounds):
        ps = prompts(seed)
        llm.reset_prefix_cache()
        cold = run_steady(llm, ps["B"], rate, 64)
        llm.reset_prefix_cache()
        run(llm, ps["A"])
        res["steady"].append({"rate": rate, "cold": cold, "own": run_steady(llm, ps["B"], rate, 64)})
    singles = prompts(500)
    for i in range(SINGLES):
        llm.reset_prefix_cache()
        run(llm, singles["A"][i : i + 1])
        res["single"]["B"].append(run(llm, singles["B"][i : i + 1])["tokens"][0])
        llm.reset_prefix_cache()
        res["single"]["B_cold"].append(run(llm, singles["B"][i : i + 1])["tokens"][0])
        llm.reset_prefix_cache()
        run(llm, singles["P"][i : i + 1], max_tokens=1)
        own = run(llm, singles["P"][i : i + 1])
        res["single"]["P"].append(own["tokens"][0])
        res["single"]["P_ttft_ms"] += own["ttft_ms"]
    close(llm)
    keep_timelines(pdir, args.out)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvp-vllm-graphs"), help="the model and profiles")
    ap.add_argument("--phases", nargs="*", default=["pool", "nixl", "plain"],
                    choices=[*POOL_VARIANTS, "nixl", "plain", *PASSIVE])  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="batches of 32 per burst workload")
    ap.add_argument("--rates", type=float, nargs="*", default=[8.0, 16.0], help="steady arrival rates, requests/s")
    ap.add_argument("--steady-rounds", type=int, default=1, help="batches of 32 per steady rate")
    ap.add_argument("--pool-blocks", type=int, default=16384)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "llama-1b-random"
    if not (model / "config.json").exists():
        build_model(model)
    device = torch.cuda.get_device_name()
    for phase in args.phases:
        t = time.perf_counter()
        if phase in POOL_VARIANTS or phase in PASSIVE:
            sock = args.work / "kvpool.sock"
            flags = ["--socket", str(sock), "--port", "0", "--backend", "cuda", "--num-blocks", str(args.pool_blocks),
                     "--num-layers", "16", "--num-kv-heads", "8", "--head-dim", "64", "--block-size", str(BS),
                     "--dtype", "bf16", "--model", str(model), "--log-level", "warning"]  # fmt: skip
            pool = spawn(["kvpool", "serve", *flags], socket=sock, port=0, log=args.out / "pool.log", timeout_s=120)
            try:
                url = f"unix://{sock}"
                res = (
                    pool_phase(model, url, args, POOL_VARIANTS[phase], stamps=phase not in UNSTAMPED)
                    if phase in POOL_VARIANTS
                    else plain_phase(model, args, url, stamps=phase == "plain_stamped")
                )
            finally:
                pool.stop()
        elif phase == "nixl":
            try:
                res = nixl_phase(model, args)
            except Exception as exc:  # the other phases' figures stand on their own
                res = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"nixl phase failed: {res['error']}", flush=True)
        else:
            res = plain_phase(model, args)
        res.update(device=device, seconds=round(time.perf_counter() - t, 1), args=vars(args) | {"out": "", "work": ""})
        (args.out / f"{phase}.json").write_text(json.dumps(res))
        print(f"phase {phase} done in {res['seconds']} s", flush=True)
    s = {v: summary(args.out, v) for v in POOL_VARIANTS if (args.out / f"{v}.json").exists()} or summary(args.out)
    if quiet := passive(args.out, PASSIVE):
        s["passive_burst_ttft_p50_ms"] = quiet
    (args.out / "summary.json").write_text(json.dumps(s, indent=1))
    print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
