"""What the e2e suite prints and plots: goodput and latency by rate, and the targets checked."""

from __future__ import annotations

from typing import Any

from kvpool.benchmarks import harness, machine
from kvpool.benchmarks.e2e_workload import WORKLOADS

#: (scenario, the side kvpool wins with, its baseline)
SIDES = {"1": ("pool", "mono"), "2": ("pool-2gpu", "mono-x2"), "3": ("shared-2p", "private-2p"),
         "4": ("pool-host", "pool-nohost")}  # fmt: skip


def rates(cfg: dict[str, Any], scenario: str) -> list[float]:
    return {"3": cfg["prefill_rates"], "4": cfg["host_rates"]}.get(scenario, cfg["rates"])


def row(report: harness.Report, scenario: str, side: str, workload: str, rate: float) -> dict[str, Any] | None:
    for r in report.results:
        if (r["scenario"], r["side"], r["workload"], r["rate"]) == (scenario, side, workload, rate):
            return r
    return None


def targets(report: harness.Report) -> None:
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
        for rate in rates(cfg, s):
            mixed, unique = row(report, s, side, "mixed", rate), row(report, s, side, "unique", rate)
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
    if "4" in scen:
        host_targets(report)
    for s in scen:
        ours, base = SIDES[s]
        best = None
        for rate in rates(cfg, s):
            for w in WORKLOADS:
                a, b = row(report, s, ours, w, rate), row(report, s, base, w, rate)
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


def host_targets(report: harness.Report) -> None:
    """Scenario 4: hit rate and TTFT with the host tier against without, and the restores' bandwidth."""
    for rate in rates(report.config, "4"):
        a, b = row(report, "4", "pool-host", "revisit", rate), row(report, "4", "pool-nohost", "revisit", rate)
        if a is None or b is None:
            continue
        ratio = a["ttft_p50_us"] / b["ttft_p50_us"]
        host = a["tiers"]["host"]
        report.targets.append(
            harness.Target(
                f"scenario 4: TTFT p50 with the host tier / without, {rate:g} req/s",
                "compare", f"{ratio:.2f}x", None,
                f"{a['ttft_p50_us'] / 1e3:.1f} ms vs {b['ttft_p50_us'] / 1e3:.1f} ms; hits {a['hit_rate']:.0%} vs "
                f"{b['hit_rate']:.0%}; restored {harness.fmt_bytes(host['restored_bytes'])} at "
                f"{host['restore_bytes_per_s'] / 1e9:.1f} GB/s, offloaded {harness.fmt_bytes(host['offloaded_bytes'])} "
                f"at {host['offload_bytes_per_s'] / 1e9:.1f} GB/s (the pool's own figures, copies end to end)",
            )
        )  # fmt: skip


def body(report: harness.Report) -> str:
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


def plot(report: harness.Report) -> Any:
    plt = harness.pyplot()
    scen = report.config["scenarios"]
    fig, axes = plt.subplots(2, len(scen), figsize=(6 * len(scen), 8), squeeze=False)
    for col, s in enumerate(scen):
        for side in sorted({r["side"] for r in report.results if r["scenario"] == s}):
            for w, style in zip((*WORKLOADS, "revisit"), ("--", "-", "-."), strict=True):
                rows = sorted((r for r in report.results if (r["scenario"], r["side"], r["workload"]) == (s, side, w)),
                              key=lambda r: r["rate"])  # fmt: skip
                if not rows:
                    continue
                xs = [r["rate"] for r in rows]
                axes[0][col].plot(xs, [r["goodput_rps"] for r in rows], style, marker="o", label=f"{side} {w}")
                axes[1][col].plot(xs, [r["ttft_p50_us"] / 1e3 for r in rows], style, marker="o",
                                  label=f"{side} {w}")  # fmt: skip
        offered = rates(report.config, s)
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
