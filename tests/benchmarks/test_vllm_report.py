"""The vLLM benchmarks' bookkeeping, and smoke runs of those that need no GPU (one needs vLLM: it skips without)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.benchmarks.vllm_drive import per_transfer, profile_delta
from kvpool.benchmarks.vllm_graphs_report import summary


def run(ttft: list[float], tokens: list[list[int]], tpot: list[float] | None = None) -> dict:
    return {"ttft_ms": ttft, "tpot_ms": tpot or [1.0] * len(ttft), "tokens": tokens}


def test_profile_delta_keeps_only_what_happened_between_the_reads() -> None:
    before = {"worker": {"load_gpu": {"n": 2, "total_ms": 3.0}, "save_launch_cpu": {"n": 5, "total_ms": 1.0}}}
    after = {"worker": {"load_gpu": {"n": 5, "total_ms": 9.0}, "save_launch_cpu": {"n": 5, "total_ms": 1.0},
                        "load_requests": {"n": 3, "total_ms": 96}}}  # fmt: skip
    assert profile_delta(before, after) == {"worker.load_gpu": {"n": 3, "total": 6.0},
                                            "worker.load_requests": {"n": 3, "total": 96}}  # fmt: skip


def test_per_transfer_is_the_mean_over_the_transfers_between_two_reads() -> None:
    before = {"vllm:nixl_xfer_time_seconds": {"count": 2, "sum": 0.004}}
    after = {"vllm:nixl_xfer_time_seconds": {"count": 6, "sum": 0.012},
             "vllm:nixl_bytes_transferred": {"count": 4, "sum": 4096.0}}  # fmt: skip
    assert per_transfer(before, after) == {"transfers": 4, "xfer_time_seconds_mean_ms": 2.0,
                                           "bytes_transferred_mean": 1024.0}  # fmt: skip


def test_the_summary_compares_the_phases_that_ran(tmp_path) -> None:
    a, b = [1, 2], [1, 3]
    plain = {"device": "X", "start_s": 40.0, "burst": [{"cold": run([100.0, 120.0], [a, a]),
                                                        "own": run([70.0, 80.0], [a, b])}],
             "P": [run([60.0, 60.0], [a, a])], "steady": [{"rate": 8.0, "cold": run([20.0], [a]),
                                                           "own": run([10.0], [a])}],
             "single": {"B": [a], "B_cold": [a], "P": [b]}}  # fmt: skip
    pool = {"device": "X", "burst": [run([55.0, 65.0], [a, a]) | {"pool": {"hit_blocks_B": 96}}],
            "steady": [{"rate": 8.0, **run([8.0], [a])}], "ttft_profile": {},
            "pair": [{"prefill": run([30.0, 30.0], [[7], [7]]), "decode": run([9.0, 11.0], [a, a])}],
            "pair_profile": {"scheduler.claim_call": {"n": 2, "total": 0.5},
                             "worker.load_gpu": {"n": 1, "total": 4.0},
                             "worker.load_requests": {"n": 1, "total": 2}},
            "single": {"B": [a], "P": [a]}}  # fmt: skip
    for name, res in (("plain", plain), ("pool", pool)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    s = summary(tmp_path)
    assert s["phases"] == ["plain", "pool"]
    assert s["burst_ttft_p50_ms"] == {"B_cold": 110.0, "B_own_cache": 75.0, "B_pool": 60.0}
    assert s["burst_ratio_vs_cold"] == {"pool": 0.545, "own_cache": 0.682}
    assert s["burst_rounds_ttft_p50_ms"] == {"B_cold": [110.0], "B_own_cache": [75.0], "B_pool": [60.0]}
    assert s["steady_ttft_p50_ms"]["8.0"] == {"cold": 20.0, "own_cache": 10.0, "pool": 8.0, "pool_vs_cold": 0.4,
                                              "own_cache_vs_cold": 0.5}  # fmt: skip
    assert s["pair_kvpool"]["claim_call_ms_per_request"] == 0.25
    assert s["pair_kvpool"]["load_gpu_ms_per_request"] == 2.0
    assert s["pair_kvpool"]["decode_ttft_p50_ms"] == 10.0
    assert s["identical"]["burst_B_pool_vs_own_cache"] == "1/2"
    assert s["identical"]["single_P_kvpool_pair_vs_own_cache"] == "0/1"
    assert "pair_nixl" not in s


def test_the_timeline_lays_the_main_step_of_a_burst_beside_vllms_stamps(tmp_path) -> None:
    from kvpool.benchmarks.vllm_timeline import report

    t = 100.0
    stamps = [(t, t + 0.001, t + 0.030)] + [(t + 0.010 + i * 1e-4, t + 0.012, t + 0.060) for i in range(3)]
    burst = run([30.0, 60.0, 60.0, 60.0], [[1]] * 4) | {"core_ts": stamps}
    (tmp_path / "pool_flat.json").write_text(json.dumps({"burst": [burst]}))
    marks = [(0.0105, "lookups"), (0.011, "lookups"), (0.0125, "plan", {"loads": 3}), (0.014, "forward"),
             (0.055, "saver_wait"), (0.002, "plan", {"loads": 1})]  # fmt: skip
    (tmp_path / "timelines").mkdir()
    lines = [json.dumps({"t": t + m[0], "k": m[1], **(m[2] if len(m) > 2 else {})}) for m in marks]
    (tmp_path / "timelines" / "e2-timeline-scheduler-1.jsonl").write_text("\n".join(lines) + "\n")
    step = report(tmp_path)["pool_flat"][0]
    assert step == {"requests": 3, "queued": 10.2, "lookups": 11.0, "planned": 12.5, "forward": 14.0,
                    "gpu_done": 55.0, "first_token": 60.0}  # fmt: skip


def test_the_timeline_of_a_passive_connector_takes_the_first_plan_after_vllm_scheduled(tmp_path) -> None:
    """``plain_stamped``: vLLM's own cache with the connector loading nothing, its plans all without loads."""
    from kvpool.benchmarks.vllm_timeline import report

    t = 200.0
    stamps = [(t, t + 0.001, t + 0.030)] + [(t + 0.010 + i * 1e-4, t + 0.012, t + 0.050) for i in range(3)]
    case = run([30.0, 50.0, 50.0, 50.0], [[1]] * 4) | {"core_ts": stamps}
    (tmp_path / "plain_stamped.json").write_text(json.dumps({"burst": [{"own": case, "cold": case}]}))
    marks = [(0.002, "plan", {"loads": 0}), (0.0135, "plan", {"loads": 0}), (0.016, "forward")]
    (tmp_path / "timelines").mkdir()
    lines = [json.dumps({"t": t + m[0], "k": m[1], **(m[2] if len(m) > 2 else {})}) for m in marks]
    (tmp_path / "timelines" / "e2-timeline-scheduler-1.jsonl").write_text("\n".join(lines) + "\n")
    got = report(tmp_path)
    assert got["stamped_own"][0] == {"requests": 3, "queued": 10.2, "lookups": None, "planned": 13.5,
                                     "forward": 16.0, "gpu_done": None, "first_token": 50.0}  # fmt: skip
    assert got["stamped_cold"] == got["stamped_own"]


def test_the_passive_phases_burst_ttft_is_reported_beside_the_plain_engines(tmp_path) -> None:
    from kvpool.benchmarks.vllm_graphs_report import passive

    def burst(cold: list[float], own: list[float]) -> dict:
        half = len(cold) // 2  # two rounds
        return {"burst": [{"cold": run(c, [[1]] * len(c)), "own": run(o, [[1]] * len(o))}
                          for c, o in ((cold[:half], own[:half]), (cold[half:], own[half:]))]}  # fmt: skip

    assert passive(tmp_path, ("plain_passive",)) == {}
    (tmp_path / "plain.json").write_text(json.dumps(burst([100.0, 120.0, 140.0], [50.0, 60.0, 70.0])))
    assert passive(tmp_path, ("plain_passive",)) == {}  # nothing to set beside the plain engine
    (tmp_path / "plain_passive.json").write_text(json.dumps(burst([90.0, 110.0, 130.0], [55.0, 65.0, 75.0])))
    assert passive(tmp_path, ("plain_stamped", "plain_passive")) == {
        "plain": {
            "B_cold": 120.0,
            "B_own_cache": 60.0,
            "B_cold_rounds": [100.0, 130.0],
            "B_own_cache_rounds": [50.0, 65.0],
        },
        "plain_passive": {
            "B_cold": 110.0,
            "B_own_cache": 65.0,
            "B_cold_rounds": [90.0, 120.0],
            "B_own_cache_rounds": [55.0, 70.0],
        },
    }


def test_the_saver_benchmark_runs_alone_and_beside_a_thread_holding_the_gil(tmp_path) -> None:
    """A smoke test of ``vllm_saves`` (CPU, no vLLM): it saves every block it is given and writes both cases."""
    out = tmp_path / "saves.json"
    cmd = [sys.executable, "-m", "kvpool.benchmarks.vllm_saves", "--prompts", "3", "--held", "2", "--new", "2",
           "--rounds", "3", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"alone", "beside a thread holding the GIL"}
    assert all(c["n"] == 1 and c["wall_ms_p50"] > 0 for c in cases.values())


def test_the_schedule_benchmark_times_both_schedulers_and_the_connector_calls(tmp_path) -> None:
    """A smoke test of ``vllm_schedule`` (vLLM on the CPU; skipped without it): every prompt of the burst is
    scheduled with its prefix hit, by vLLM's own cache and through the pool, and the figures are written."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install 'kvpool[vllm]')")
    out = tmp_path / "schedule.json"
    cmd = [sys.executable, "-m", "kvpool.benchmarks.vllm_schedule", "--requests", "4", "--rounds", "2",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got["schedule_ms_p50"]) == {"own prefix cache", "kvpool connector"}
    assert set(got["connector_calls_ms_p50"]) == {"get_num_new_matched_tokens", "update_state_after_alloc",
                                                  "build_connector_meta"}  # fmt: skip
