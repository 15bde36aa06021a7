"""The summary of :mod:`.vllm_graphs`: TTFT and TPOT p50 per workload, the pair's KV handover per request through
kvpool and through NIXL, and how many requests got the same greedy tokens, from whichever phases' files exist."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.benchmarks.vllm_engines import p50


def _cat(runs: list[dict], field: str) -> list[float]:
    return [x for r in runs for x in r[field]]


def _toks(runs: list[dict]) -> list[list[int]]:
    return [t for r in runs for t in r["tokens"]]


def _rounds(runs: list[dict]) -> list[float]:
    """Each round's p50: how a burst's split into steps moves from one round to the next."""
    return [p50(r["ttft_ms"]) for r in runs]


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def _per(profile: dict[str, dict[str, float]], kind: str, by: str | None = None) -> float | None:
    """Mean of a profile kind per event, or per unit of another kind's total (requests, blocks)."""
    v = profile.get(kind)
    if not v:
        return None
    d = profile.get(by, {}).get("total") if by else v["n"]
    return round(v["total"] / d, 4) if d else None


def _pair(res: dict[str, Any]) -> dict[str, float]:
    return {
        "prefill_ttft_p50_ms": p50(_cat([r["prefill"] for r in res["pair"]], "ttft_ms")),
        "decode_ttft_p50_ms": p50(_cat([r["decode"] for r in res["pair"]], "ttft_ms")),
        "decode_tpot_p50_ms": p50(_cat([r["decode"] for r in res["pair"]], "tpot_ms")),
    }


def summary(out: Path, pool_variant: str = "pool") -> dict[str, Any]:
    """The figures of one pool variant's phase (its file ``<pool_variant>.json``) beside the others'."""
    files = {p: out / f"{p}.json" for p in ("pool", "nixl", "plain")}
    files["pool"] = out / f"{pool_variant}.json"
    got = {p: json.loads(f.read_text()) for p, f in files.items() if f.exists()}
    pool, nixl, plain = got.get("pool"), got.get("nixl"), got.get("plain")
    s: dict[str, Any] = {"device": next(iter(got.values()), {}).get("device"), "phases": sorted(got)}
    for name, res in got.items():
        s[f"start_s_{name}"] = {k: v for k, v in res.items() if k.startswith("start_s")}
    if plain:
        burst = plain["burst"]
        s["burst_ttft_p50_ms"] = {"B_cold": p50(_cat([r["cold"] for r in burst], "ttft_ms")),
                                  "B_own_cache": p50(_cat([r["own"] for r in burst], "ttft_ms"))}  # fmt: skip
        s["burst_tpot_p50_ms"] = {"B_cold": p50(_cat([r["cold"] for r in burst], "tpot_ms"))}
        s["burst_rounds_ttft_p50_ms"] = {"B_cold": _rounds([r["cold"] for r in burst]),
                                         "B_own_cache": _rounds([r["own"] for r in burst])}  # fmt: skip
        s["P_own_cache_ttft_p50_ms"] = p50(_cat(plain["P"], "ttft_ms"))
    if pool:
        s.setdefault("burst_ttft_p50_ms", {})["B_pool"] = p50(_cat(pool["burst"], "ttft_ms"))
        s.setdefault("burst_tpot_p50_ms", {})["B_pool"] = p50(_cat(pool["burst"], "tpot_ms"))
        s.setdefault("burst_rounds_ttft_p50_ms", {})["B_pool"] = _rounds(pool["burst"])
        s["pool_per_burst_round"] = [r["pool"] for r in pool["burst"]]
        s["pool_ttft_profile"] = pool["ttft_profile"]
    if plain and pool:
        b = s["burst_ttft_p50_ms"]
        s["burst_ratio_vs_cold"] = {"pool": round(b["B_pool"] / b["B_cold"], 3),
                                    "own_cache": round(b["B_own_cache"] / b["B_cold"], 3)}  # fmt: skip
    steady: dict[str, dict[str, float]] = {}
    for r in (plain or {}).get("steady", []):
        row = steady.setdefault(str(r["rate"]), {})
        row.setdefault("cold", []).extend(r["cold"]["ttft_ms"])
        row.setdefault("own_cache", []).extend(r["own"]["ttft_ms"])
    for r in (pool or {}).get("steady", []):
        steady.setdefault(str(r["rate"]), {}).setdefault("pool", []).extend(r["ttft_ms"])
    s["steady_ttft_p50_ms"] = {rate: {k: p50(v) for k, v in row.items()} for rate, row in steady.items()}
    for row in s["steady_ttft_p50_ms"].values():
        if "cold" in row:
            row.update({f"{k}_vs_cold": round(row[k] / row["cold"], 3) for k in ("pool", "own_cache") if k in row})
    if pool:
        prof = pool["pair_profile"]
        s["pair_kvpool"] = _pair(pool) | {
            "claim_call_ms_per_request": _per(prof, "scheduler.claim_call", "scheduler.claim_batch_size")
            if "scheduler.claim_batch_size" in prof
            else _per(prof, "scheduler.claim_call"),  # claims went one call each before they were batched
            "claims_per_call": _per(prof, "scheduler.claim_batch_size"),
            "claim_queued_ms_per_request": _per(prof, "scheduler.claim_queued"),
            "load_gpu_ms_per_step": _per(prof, "worker.load_gpu"),
            "load_gpu_ms_per_request": _per(prof, "worker.load_gpu", "worker.load_requests"),
            "requests_per_load_step": _per(prof, "worker.load_requests"),
            "load_launch_cpu_ms_per_step": _per(prof, "worker.load_launch_cpu"),
        }
    if nixl:
        s["pair_nixl"] = {"error": nixl["error"]} if "error" in nixl else _pair(nixl) | nixl["per_transfer"]
    singles = {k: r["single"].get("P_ttft_ms") for k, r in (("plain_own_cache", plain), ("kvpool", pool),
                                                             ("nixl", nixl)) if r and "single" in r}  # fmt: skip
    s["single_P_decode_ttft_p50_ms"] = {k: p50(v) for k, v in singles.items() if v}
    s["identical"] = _identical(pool, nixl, plain)
    return s


def _identical(pool: dict | None, nixl: dict | None, plain: dict | None) -> dict[str, str]:
    if not plain:
        return {}
    own, ps = _toks([r["own"] for r in plain["burst"]]), plain["single"]
    out = {"single_B_own_cache_vs_cold": agree(ps["B"], ps["B_cold"])}
    if pool:
        out |= {
            "single_B_pool_vs_own_cache": agree(pool["single"]["B"], ps["B"]),
            "single_P_kvpool_pair_vs_own_cache": agree(pool["single"]["P"], ps["P"]),
            "burst_B_pool_vs_own_cache": agree(_toks(pool["burst"]), own),
            "burst_P_kvpool_pair_vs_own_cache": agree(_toks([r["decode"] for r in pool["pair"]]), _toks(plain["P"])),
        }
    if nixl and "error" not in nixl:
        out |= {
            "single_P_nixl_pair_vs_own_cache": agree(nixl["single"]["P"], ps["P"]),
            "burst_P_nixl_pair_vs_own_cache": agree(_toks([r["decode"] for r in nixl["pair"]]), _toks(plain["P"])),
        }
        if nixl["single"].get("P_producer_own"):
            out["single_P_nixl_pair_vs_producer_own_cache"] = agree(
                nixl["single"]["P"], nixl["single"]["P_producer_own"]
            )
    return out


def passive(out: Path, phases: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """B's burst TTFT p50, cold and on vLLM's own cache, of each plain phase that ran with the connector passive,
    beside the plain engine's (``plain``) where it ran too."""
    got = {}
    for phase in ("plain", *phases):
        f = out / f"{phase}.json"
        if f.exists():
            burst = json.loads(f.read_text())["burst"]
            got[phase] = {"B_cold": p50(_cat([r["cold"] for r in burst], "ttft_ms")),
                          "B_own_cache": p50(_cat([r["own"] for r in burst], "ttft_ms")),
                          "B_cold_rounds": _rounds([r["cold"] for r in burst]),
                          "B_own_cache_rounds": _rounds([r["own"] for r in burst])}  # fmt: skip
    return got if len(got) > ("plain" in got) else {}
