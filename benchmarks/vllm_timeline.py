"""Where a burst's time goes on the engine that loads from the pool, step by step, from a :mod:`.vllm_graphs` run.

vLLM stamps each request when its engine core queues it, schedules it and emits its first token; the connector's
timeline (``profile_dir``) stamps its own events on the same monotonic clock. Laid side by side they say, for the
step that carries most of a burst: when its requests had reached the engine core, when their pool lookups were
answered, when vLLM finished scheduling them (the connector's plan), when the forward began, when the GPU had
run it (the saver's wait for the step's copies ends then) and when the first tokens came out.

    python -m kvpool.benchmarks.vllm_timeline results/   # the pool_* files (and plain_stamped's) and timelines there
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLUMNS = ("queued", "lookups", "planned", "forward", "gpu_done", "first_token")


def events(directory: Path) -> list[dict[str, Any]]:
    """Every connector event of engine 2 (the one loading from the pool), in time order."""
    out = []
    for f in sorted((directory / "timelines").glob("e2-timeline-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line]
    return sorted(out, key=lambda e: e["t"])


def main_step(run: dict[str, Any], evs: list[dict[str, Any]], passive: bool = False) -> dict[str, float] | None:
    """Milestones of the step that scheduled most of ``run``'s requests, in ms after the first was queued; with
    ``passive`` (a connector that loads nothing), its first plan after vLLM scheduled that step."""
    stamps = run.get("core_ts")
    if not stamps:
        return None
    t0 = min(q for q, _, _ in stamps)
    steps: dict[float, list[tuple[float, float, float]]] = {}
    for s in stamps:
        steps.setdefault(s[1], []).append(s)
    sched, members = max(steps.items(), key=lambda kv: len(kv[1]))
    end = max(f for _, _, f in members)
    window = [e for e in evs if t0 - 0.001 <= e["t"] <= end + 0.005]
    plan = next((e for e in window if e["k"] == "plan" and e["t"] >= sched and (passive or e.get("loads"))), None)
    if plan is None:
        return None
    looked = [e["t"] for e in window if e["k"] in ("lookups", "lookup", "claims", "claim") and e["t"] <= plan["t"]]
    forward = next((e["t"] for e in window if e["k"] == "forward" and e["t"] >= plan["t"]), None)
    done = next((e["t"] for e in window if e["k"] == "saver_wait" and e["t"] >= plan["t"]), None)

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1e3, 2)

    return {
        "requests": len(members), "queued": ms(max(q for q, _, _ in members)),
        "lookups": ms(max(looked) if looked else None), "planned": ms(plan["t"]), "forward": ms(forward),
        "gpu_done": ms(done), "first_token": ms(end),
    }  # fmt: skip


def report(directory: Path) -> dict[str, list[dict[str, float] | None]]:
    evs = events(directory)
    out = {}
    for f in sorted(directory.glob("pool*.json")):
        res = json.loads(f.read_text())
        out[f.stem] = [main_step(run, evs) for run in res.get("burst", [])]
    stamped = directory / "plain_stamped.json"
    if stamped.exists():
        res = json.loads(stamped.read_text())
        for case in ("own", "cold"):
            out[f"stamped_{case}"] = [main_step(run[case], evs, passive=True) for run in res.get("burst", [])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="the --out directory of a vllm_graphs run")
    found = report(ap.parse_args().results)
    print(f"{'phase':12s} {'round':>5s} {'reqs':>4s} " + " ".join(f"{c:>11s}" for c in COLUMNS))
    for phase, rounds in found.items():
        for i, r in enumerate(rounds):
            if r is not None:
                cells = " ".join(f"{r[c]:11.1f}" if r[c] is not None else f"{'-':>11s}" for c in COLUMNS)
                print(f"{phase:12s} {i:5d} {r['requests']:4d} {cells}")


if __name__ == "__main__":
    main()
