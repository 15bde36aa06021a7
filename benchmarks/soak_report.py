"""What the soak reports: the summary of a run (ops by kind, errors, the books at the start and the end, the
violations), printed as a table and plotted beside the blocks in use over time."""

from __future__ import annotations

import argparse
import collections
from typing import Any

from kvpool.benchmarks import harness
from kvpool.benchmarks.soak_client import OPS, Tally


def summarize(args: argparse.Namespace, tally: Tally, elapsed: float, kinds: list[tuple[str, str, bool]],
              start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {
        "duration_s": round(elapsed, 2),
        "clients": dict(collections.Counter(k for k, _, _ in kinds)),
        "ops": {k: tally.ops[k] for k in [*OPS, *sorted(set(tally.ops) - set(OPS))]},
        "ops_per_s": {k: round(tally.ops[k] / elapsed, 1) for k in [*OPS, *sorted(set(tally.ops) - set(OPS))]},
        "errors": dict(tally.errors),
        "samples": tally.samples,
        "book_checks": tally.book_checks,
        "stranded_blocks": tally.stranded,
        "max_in_use": tally.max_in_use,
        "num_blocks": end["num_blocks"],
        "crashed_workers": tally.crashed,
        "pool_pauses": tally.pauses,
        "lost_sessions": tally.lost,
        "stale_refused": end["counters"]["stale_refused"],
        "end": {k: end[k] for k in ("free", "in_use", "cached", "handoffs", "sessions")},
        "start": {k: start[k] for k in ("free", "in_use", "cached", "handoffs", "sessions")},
        "violations": tally.violation_count,
        "violation_messages": tally.violations,
        "verify_data": not args.no_verify_data,
        "host_tier": {k: v for k, v in end.get("tiers", {}).get("host", {}).items() if k.endswith("blocks")},
        "slabs": {k: v for k, v in end.get("slabs", {}).get("counters", {}).items() if k.startswith("handed")},
    }


def print_summary(s: dict[str, Any]) -> None:
    clients = ", ".join(f"{n} {k}" for k, n in s["clients"].items())
    lines = [f"kvpool soak: {s['duration_s']} s, {sum(s['clients'].values())} clients ({clients})", ""]
    kinds = [*OPS, *sorted(k for k in s["ops"] if k not in OPS)]
    lines.append(harness.table(["op", "count", "ops/s"], [[k, s["ops"][k], s["ops_per_s"][k]] for k in kinds]))
    lines.append("")
    total = sum(s["ops"].values())
    lines.append(f"total {total} ops, {total / max(s['duration_s'], 1e-9):.0f} ops/s")
    lines.append("errors by kind (507 on alloc and 404 on claim are expected; anything else is a violation):")
    lines += [f"  {k}: {n}" for k, n in sorted(s["errors"].items())] or ["  none"]
    lines.append(f"/stats samples: {s['samples']}, all balanced unless listed below; "
                 f"max in use {s['max_in_use']} of {s['num_blocks']}")  # fmt: skip
    lines.append(f"live books: {s['book_checks']} checks of a paused client against its session's blocks, "
                 f"{s['stranded_blocks']} stranded (held by the session, unknown to its client)")  # fmt: skip
    lines.append(f"killed workers: {s['crashed_workers']}; pool pauses past the lease: {s['pool_pauses']}, "
                 f"calls refused for a lost session: {s['lost_sessions']}")  # fmt: skip
    lines.append(f"calls refused by the pool for stale ids (kvpool_stale_refused): {s['stale_refused']}")
    if s["host_tier"]:
        lines.append(f"host tier: {s['host_tier']}")
    if s["slabs"]:
        lines.append(f"slab handoffs' blocks (settled: reached the consumer; parked: a killed producer's ring's, for "
                     f"its consumer): {s['slabs']}")  # fmt: skip
    lines.append(f"end: {s['end']} (start: {s['start']})")
    lines.append(f"violations: {s['violations']}")
    lines += [f"  - {m}" for m in s["violation_messages"]]
    lines.append("FAIL" if s["violations"] else "PASS")
    print("\n".join(lines), flush=True)


def plot(summary: dict[str, Any], in_use: list[tuple[float, int]]) -> Any:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    kinds = list(summary["ops_per_s"])
    axes[0].bar(kinds, [summary["ops_per_s"][k] for k in kinds])
    axes[0].set(title=f"operations per second, {sum(summary['clients'].values())} clients", ylabel="ops/s")
    axes[0].tick_params(axis="x", labelrotation=25)
    axes[0].grid(True, axis="y", alpha=0.3)
    axes[1].plot([t for t, _ in in_use], [n for _, n in in_use], lw=1, label="in use")
    axes[1].axhline(summary["num_blocks"], color="grey", lw=0.8, ls="--", label="arena blocks")
    axes[1].set(title="blocks in use, sampled from /stats", xlabel="s", ylabel="blocks")
    axes[1].legend(fontsize=8)
    axes[1].grid(True, alpha=0.3)
    verdict = "PASS" if not summary["violations"] else f"FAIL ({summary['violations']} violations)"
    fig.suptitle(f"kvpool soak: {summary['duration_s']} s, workers killed: {summary['crashed_workers']}, {verdict}")
    return fig
