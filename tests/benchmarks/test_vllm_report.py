"""``kvpool bench vllm`` without vLLM or a GPU: its options, its workload, and its figures from recorded runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.benchmarks import harness, machine
from kvpool.benchmarks import vllm as suite
from kvpool.server.launch import SOURCE_ROOT, child_env


def run(ttft: list[float], tokens: list[list[int]], cached: list[int] | None = None, prompt: int = 8) -> dict:
    return {"ttft_ms": ttft, "tpot_ms": [1.0] * len(ttft), "tokens": tokens, "prompt_tokens": [prompt] * len(ttft),
            "cached": cached or [0] * len(ttft)}  # fmt: skip


def raw_of(name: str, burst: list[dict], pair: list[dict], singles: dict[str, list[dict]]) -> dict:
    return {"start_s": 1.0, "prefix": {"burst": burst}, "pair": pair, "singles": singles}


def test_options_are_read_and_a_bad_one_is_named() -> None:
    assert suite.names("plain,copy") == ["plain", "copy"]
    assert suite.arrivals("burst, 8") == ["burst", 8.0]
    assert suite.share("0.5") == 0.5
    for parse, text in ((suite.names, "plain,resident?"), (suite.arrivals, "8,fast"), (suite.arrivals, "-1"),
                        (suite.share, "1.5")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_the_help_needs_neither_vllm_nor_a_gpu() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.benchmarks", "vllm", "--help"], capture_output=True,
                          text=True, cwd=SOURCE_ROOT, env=child_env(), timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage: kvpool bench vllm" in done.stdout and "--arrivals" in done.stdout
    for name in suite.ENGINES:
        assert f"\n  {name} " in done.stdout


def test_without_a_gpu_it_stops_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.benchmarks", "vllm", "--device", "cpu"], capture_output=True,
                          text=True, cwd=SOURCE_ROOT, env=child_env(), timeout=120, check=False)  # fmt: skip
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        == "kvpool bench vllm: needs a CUDA GPU (vLLM's engines run there); --device cpu cannot run it"
    )


def test_an_engine_configuration_is_one_entry() -> None:
    """What the connector's configurations have in common (two engines on a pool) follows from the entry alone."""
    assert [n for n, c in suite.ENGINES.items() if c.engines == 2] == ["copy", "resident"]
    extra = suite.EngineConfig(
        "a mode of the connector", connector={"mode": "x"}, pool_flags=("--order", "block_major")
    )
    assert extra.engines == 2 and extra.prefix_caching and not extra.resident
    assert extra.pool_args(100) == ["--num-blocks", "100", "--order", "block_major"]
    resident = suite.ENGINES["resident"].pool_args(100)
    assert resident[:2] == ["--num-blocks", "100"] and "kv_packed" in resident and "--slabs" in resident
    assert resident[resident.index("--slab-max-blocks") + 1] == "100", "an engine's slab may hold the whole arena"


def test_a_and_b_share_the_prefix_and_p_shares_nothing() -> None:
    ps = suite.prompts(7, n=3, prompt_len=64, prefix_len=48)
    assert ps == suite.prompts(7, n=3, prompt_len=64, prefix_len=48)
    for a, b in zip(ps["A"], ps["B"], strict=True):
        assert len(a) == len(b) == 64 and a[:48] == b[:48] and a[48:] != b[48:]
    assert all(p[:16] not in (a[:16] for a in ps["A"]) for p in ps["P"])
    assert ps["A"][0][:48] != ps["A"][1][:48]


def test_the_pool_is_shaped_like_the_models_kv() -> None:
    layout = suite.pool_layout({**suite.LLAMA_1B, "torch_dtype": "bfloat16"}, 16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (16, 8, 64, 16)
    assert layout.dtype == "bfloat16"
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "dtype": "float16"}
    assert suite.pool_layout(no_head_dim, 16).head_dim == 64 and suite.pool_layout(no_head_dim, 16).num_kv_heads == 4


def test_an_outcome_is_read_from_vllms_own_stamps() -> None:
    def out(tokens: list[int], first: float, last: float, cached: int) -> SimpleNamespace:
        metrics = SimpleNamespace(first_token_latency=first, first_token_ts=10.0, last_token_ts=10.0 + last,
                                  queued_ts=9.0, scheduled_ts=9.5)  # fmt: skip
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], metrics=metrics, kv_transfer_params=None,
                               num_cached_tokens=cached, prompt_token_ids=[1] * 32)  # fmt: skip

    got = suite.outcome([out([1, 2, 3], 0.05, 0.004, 16), out([4], 0.02, 0.0, -1)], 0.2)
    assert got["tokens"] == [[1, 2, 3], [4]] and got["ttft_ms"] == [50.0, 20.0]
    assert got["tpot_ms"] == [pytest.approx(2.0)]  # a request of one token has no TPOT
    assert got["cached"] == [16, 0] and got["prompt_tokens"] == [32, 32]


def recorded() -> dict:
    a, b = [1, 2], [1, 3]
    pair = [{"prefill": run([30.0, 30.0], [[7], [7]]), "decode": run([10.0, 12.0], [a, b], [4, 4])}]
    alone = {"B": [run([9.0], [a], [4])], "P": [run([8.0], [b], [4])]}
    plain = raw_of("plain", [run([70.0, 80.0], [a, b], [6, 6])], pair, alone)
    cold = raw_of("cold", [run([100.0, 120.0], [a, a])], pair, alone)
    pool_burst = run([55.0, 65.0], [a, a], [6, 6]) | {
        "pool": {"committed_by_A": 4, "committed_by_B": 2, "hit_blocks_B": 2}
    }
    copy = raw_of("copy", [pool_burst], pair, {"B": [run([9.0], [a], [4])], "P": [run([8.0], [a], [4])]})
    return {"plain": plain, "cold": cold, "copy": copy}


def test_the_rows_compare_each_configuration_with_cold_and_plain() -> None:
    rows = {(r["engine"], r["workload"]): r for r in suite.summarize(recorded())}
    assert set(rows) == {(e, w) for e in ("plain", "cold", "copy")
                         for w in ("prefix burst", "pair prefill", "pair decode", "single B", "single P")}  # fmt: skip
    burst = rows["copy", "prefix burst"]
    assert (burst["ttft_p50_ms"], burst["ttft_p50_vs_cold"], burst["cached_share"]) == (60.0, 0.545, 0.75)
    assert burst["same_tokens_as_plain"] == "1/2" and burst["pool"] == [
        {"committed_by_A": 4, "committed_by_B": 2, "hit_blocks_B": 2}
    ]
    assert rows["plain", "prefix burst"]["ttft_p50_vs_cold"] == 0.682
    assert "same_tokens_as_plain" not in rows["plain", "prefix burst"]  # the reference itself
    assert rows["copy", "single B"]["same_tokens_as_plain"] == "1/1"
    assert rows["copy", "single P"]["same_tokens_as_plain"] == "0/1"
    assert rows["cold", "prefix burst"]["ttft_p99_ms"] == 119.8


def report_of(raw: dict, tmp_path: Path) -> harness.Report:
    args = argparse.Namespace(out=tmp_path, tag="", metadata=[])
    cfg = {"engines": list(raw), "requests": 2, "prompt_len": 8, "prefix_len": 4, "block_size": 4, "new_tokens": 2,
           "rounds": 1, "cuda_graphs": True, "vllm": "0.26.0"}  # fmt: skip
    report = harness.Report("vllm", args, machine.Device("cpu"), cfg)
    report.raw, report.results = raw, suite.summarize(raw)
    suite.targets(report)
    return report


def test_the_targets_are_the_integrations_goals(tmp_path: Path) -> None:
    report = report_of(recorded(), tmp_path)
    got = {t.name: t for t in report.targets}
    tokens = got["copy: greedy tokens one request at a time as vLLM's own cache"]
    assert (tokens.measured, tokens.met) == ("B 1/1, P 0/1", False)
    ttft = got["copy: burst TTFT p50 of a prefix another engine computed / cold"]
    assert (ttft.measured, ttft.met, ttft.detail) == ("0.55x", True, "vLLM's own cache 0.68x")
    held = got["copy: each prefix held once (B's shared blocks are A's, found in the pool)"]
    assert (held.goal, held.measured, held.met) == ("2 a round", "2", True)


def test_without_the_plain_or_cold_engine_those_comparisons_are_left_out(tmp_path: Path) -> None:
    raw = recorded()
    del raw["plain"], raw["cold"]
    report = report_of(raw, tmp_path)
    assert all("same_tokens_as_plain" not in r and "ttft_p50_vs_cold" not in r for r in report.results)
    assert [t.name for t in report.targets] == [
        "copy: each prefix held once (B's shared blocks are A's, found in the pool)"
    ]


def test_the_block_and_the_files_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = report_of(recorded(), tmp_path)
    report.print_block("vllm", suite.body(report))
    out = capsys.readouterr().out
    assert "copy    prefix burst" in out and "0.545" in out and "1/2" in out
    json_path, png_path = report.save(lambda: suite.plot(report))
    assert json.loads(json_path.read_text())["suite"] == "vllm"
    if importlib.util.find_spec("matplotlib") is None:  # the bench extra: without it, the JSON alone
        assert png_path is None
    else:
        assert png_path is not None and png_path.read_bytes()[:4] == b"\x89PNG"
