"""How the vLLM benchmarks drive engines beyond one ``generate`` of a whole batch: requests sent at a steady rate,
engines with vLLM's NixlConnector, and what a connector reports about its transfers (NIXL's metrics, kvpool's
profile files).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

_ids = itertools.count()

#: vLLM's NixlConnector with one-sided reads over CUDA IPC: without this UCX falls back to TCP between two
#: processes on one GPU that has no NVLink peer (measured: 0.45 ms against 1.8 ms for 1 MiB)
NIXL_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
NIXL_METRICS = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_post_time_seconds", "vllm:nixl_bytes_transferred",
                "vllm:nixl_num_descriptors")  # fmt: skip


def sampling(max_tokens: int, params: dict | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": params} if params
        else None,
    )  # fmt: skip


def outcome(outs: list[Any], wall: float) -> dict[str, Any]:
    """Tokens, TTFT and TPOT per request (vLLM's own timestamps), in the order of ``outs``."""
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kv_transfer_params": [o.kv_transfer_params for o in outs],
        "ttft_ms": [o.metrics.first_token_latency * 1e3 for o in outs],
        "tpot_ms": [
            (o.metrics.last_token_ts - o.metrics.first_token_ts) * 1e3 / (len(o.outputs[0].token_ids) - 1)
            for o in outs
            if len(o.outputs[0].token_ids) > 1
        ],
        "wall_s": wall,
        # the engine core's monotonic clock, the connector timeline's: in vLLM's queue, scheduled, first token
        "core_ts": [(o.metrics.queued_ts, o.metrics.scheduled_ts, o.metrics.first_token_ts) for o in outs],
    }


def run_steady(
    llm: Any, batch: list[list[int]], rate: float, max_tokens: int, params: list[dict] | None = None
) -> dict[str, Any]:
    """Send ``batch`` one request every ``1/rate`` s and step the engine until all finished.

    A request is added between two engine steps, as a server's engine core takes it in; its arrival is the time
    it was due, so a step that runs past it counts in its TTFT, as it would for a client.
    """
    eng = llm.llm_engine
    t0 = time.perf_counter()
    wall0 = time.time()
    names = [f"steady-{next(_ids)}" for _ in batch]
    sps = [sampling(max_tokens, p) for p in (params or [None] * len(batch))]
    done: dict[str, Any] = {}
    sent = 0
    while len(done) < len(batch):
        now = time.perf_counter() - t0
        while sent < len(batch) and sent / rate <= now:
            eng.add_request(names[sent], {"prompt_token_ids": batch[sent]}, sps[sent], arrival_time=wall0 + sent / rate)
            sent += 1
        if eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        elif sent < len(batch):
            time.sleep(max(0.0, sent / rate - (time.perf_counter() - t0)))
    return outcome([done[n] for n in names], time.perf_counter() - t0)


def nixl_transfer(port: int) -> Any:
    """vLLM's NixlConnector for an engine started next: its side channel on ``port`` (read by the engine's own
    process when it starts, so it must be set before each engine)."""
    from vllm.config import KVTransferConfig

    os.environ.update(NIXL_ENV)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")


def nixl_prefill_params() -> dict[str, Any]:
    """What vLLM's disaggregated-serving proxy sends the prefill engine."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}  # fmt: skip


def nixl_metrics(llm: Any) -> dict[str, dict[str, float]]:
    """Count and sum of each NIXL histogram the engine exports (process-wide, so read before and after a run)."""
    out: dict[str, dict[str, float]] = {}
    try:
        metrics = llm.get_metrics()
    except Exception as exc:  # stats off or no such metrics: the run still stands
        return {"error": {"what": f"{type(exc).__name__}: {exc}"}}  # type: ignore[dict-item]
    for m in metrics:
        if m.name in NIXL_METRICS and hasattr(m, "count"):
            s = out.setdefault(m.name, {"count": 0, "sum": 0.0})
            s["count"] += m.count
            s["sum"] += m.sum
    return out


def per_transfer(before: dict, after: dict) -> dict[str, float]:
    """Mean of each NIXL histogram over the transfers between two reads (times in ms)."""
    res: dict[str, float] = {}
    for name in NIXL_METRICS:
        a, b = after.get(name), before.get(name, {"count": 0, "sum": 0.0})
        if not a or a["count"] == b["count"]:
            continue
        n = a["count"] - b["count"]
        mean = (a["sum"] - b["sum"]) / n
        key = name.removeprefix("vllm:nixl_")
        res["transfers"] = n
        res[f"{key}_mean" + ("_ms" if "seconds" in key else "")] = round(mean * 1e3 if "seconds" in key else mean, 4)
    return res


def read_profiles(directory: Path) -> dict[str, dict[str, dict[str, float]]]:
    """The connector's profile files in ``directory``, by side (scheduler, worker)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for f in sorted(directory.glob("*.json")):
        out[f.stem.split("-")[0]] = json.loads(f.read_text())
    return out


def profile_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What the connector did between two reads of its profile files: count and total per kind."""
    out: dict[str, dict[str, float]] = {}
    for side, kinds in after.items():
        for kind, v in kinds.items():
            b = before.get(side, {}).get(kind, {"n": 0, "total_ms": 0.0})
            if v["n"] > b["n"]:
                out[f"{side}.{kind}"] = {"n": v["n"] - b["n"], "total": round(v["total_ms"] - b["total_ms"], 3)}
    return out


def settle(llm: Any, seconds: float = 0.6) -> None:
    """Let a connector's profile reach its files: they are written at most twice a second, on an engine step."""
    time.sleep(seconds)
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], sampling(1), use_tqdm=False)
