"""``kvpool bench vllm`` without vLLM or a GPU: its options, its workload, and its figures from recorded runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.benchmarks import harness, machine
from kvpool.benchmarks import vllm as suite
from kvpool.benchmarks.__main__ import suite_parser
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


@pytest.mark.slow
def test_the_help_needs_neither_vllm_nor_a_gpu() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.benchmarks", "vllm", "--help"], capture_output=True,
                          text=True, cwd=SOURCE_ROOT, env=child_env(), timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage: kvpool bench vllm" in done.stdout and "--arrivals" in done.stdout
    for name in suite.ENGINES:
        assert f"\n  {name} " in done.stdout


@pytest.mark.slow
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
    assert [n for n, c in suite.ENGINES.items() if c.engines == 2] == ["copy", "resident", "peers", "offload"]
    extra = suite.EngineConfig(
        "a mode of the connector", connector={"mode": "x"}, pool_flags=("--order", "block_major")
    )
    assert extra.engines == 2 and extra.prefix_caching and not extra.resident
    assert extra.pool_args(100) == ["--num-blocks", "100", "--order", "block_major"]
    resident = suite.ENGINES["resident"].pool_args(100)
    assert resident[:2] == ["--num-blocks", "100"] and "kv_packed" in resident and "--slabs" in resident
    assert resident[resident.index("--slab-max-blocks") + 1] == "100", "an engine's slab may hold the whole arena"


def test_each_engine_has_its_gpu_and_a_pool_spanning_two_has_an_arena_on_each() -> None:
    """Today's configurations on the first GPU; peers and offload with the writer on the first and the reader on the
    second; the pair only where both engines share one arena."""
    placed = {name: config.placed() for name, config in suite.ENGINES.items()}
    assert placed == {"plain": (0,), "cold": (0,), "copy": (0, 0), "resident": (0, 0), "peers": (0, 1),
                      "offload": (0, 1)}  # fmt: skip
    assert [n for n, c in suite.ENGINES.items() if not c.pairs] == ["peers", "offload"]
    assert suite.ENGINES["peers"].placed(2) == (2, 3), "counted from --gpu"
    peers = suite.ENGINES["peers"]
    assert peers.resident and peers.connector is not None and peers.gpus_needed == 2
    args = peers.pool_args(100)
    assert args[:4] == ["--num-blocks", "100", "--devices", "0,1"], "--num-blocks is each arena's size"
    assert "kv_packed" in args and args[args.index("--slab-max-blocks") + 1] == "100"
    assert peers.pool_args(100, first=2)[2:4] == ["--devices", "2,3"]
    assert "--devices" not in suite.ENGINES["resident"].pool_args(100, first=1), "one GPU: the run's --device"
    offload = suite.ENGINES["offload"]
    assert offload.offload and offload.connector is None and not offload.resident, "no kvpool pool"
    for gpus in ((0, 1, 2), (-1,)):
        with pytest.raises(ValueError, match="one GPU ordinal per engine"):
            suite.EngineConfig("bad", gpus=gpus)


def test_by_default_what_fits_and_two_gpus_asked_of_one_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_gpu = ["plain", "cold", "copy", "resident"]
    assert suite.chosen(None, 0, 1) == one_gpu
    assert suite.chosen(None, 0, 2) == list(suite.ENGINES)
    assert suite.chosen(None, 1, 2) == one_gpu, "--gpu 1 of two: the second GPU is the last one"
    assert suite.chosen(["cold", "peers"], 0, 2) == ["cold", "peers"]
    with pytest.raises(SystemExit) as refused:
        suite.chosen(["cold", "plain", "peers", "offload"], 0, 1)
    assert str(refused.value) == (
        "kvpool bench vllm: peers and offload need 2 GPUs (an engine on each) from --gpu 0, and this process sees "
        "1: leave them out of --engines, or run on a node with 2 GPUs"
    )
    # the whole run: refused after the device check, before vLLM is imported, a model built or a pool started
    import torch

    monkeypatch.setattr(machine, "resolve_device", lambda args: machine.Device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(suite, "require_vllm", lambda: pytest.fail("vLLM was asked for before the engines"))
    args = suite_parser("vllm").parse_args(["--engines", "cold,peers"])
    assert args.engines == ["cold", "peers"]
    with pytest.raises(SystemExit, match=r"^kvpool bench vllm: peers needs 2 GPUs"):
        suite.run(args)
    assert suite_parser("vllm").parse_args([]).engines is None, "the default is chosen once the GPUs are counted"


def test_an_engine_starts_with_its_gpu_alone_visible_and_the_variable_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with suite.on_gpu(1) as gpu:
        assert gpu == os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")  # this process's ordinal 1 is the node's GPU 5
    with suite.on_gpu(1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3, 5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    with suite.on_gpu(0):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    with pytest.raises(RuntimeError, match="engine failed"), suite.on_gpu(1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
        raise RuntimeError("engine failed")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb", "restored on an error too"
    refused = pytest.raises(SystemExit, match="GPU 2 is not among CUDA_VISIBLE_DEVICES='GPU-aaaa,GPU-bbbb'")
    with refused, suite.on_gpu(2):
        pytest.fail("entered")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError), suite.on_gpu(0):
        raise RuntimeError
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_each_engine_is_told_its_cache_and_its_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``vllm.LLM`` gets, with a stand-in for vLLM: a resident engine's GPU cache is its arena's blocks (each
    arena of a pool with several has --pool-blocks); an offload engine's is as large, with vLLM's CPU offloading
    connector and its CPU cache; engine cores are spawned, so that each reads its CUDA_VISIBLE_DEVICES."""
    made: list[dict[str, Any]] = []
    fake = SimpleNamespace(LLM=lambda **kw: made.append(kw) or kw)
    fake_config = SimpleNamespace(KVTransferConfig=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.config", fake_config)
    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(name, raising=False)
    args = suite_parser("vllm").parse_args(["--quick", "--pool-blocks", "500", "--engines", "plain"])
    cfg = suite.config_of(args) | {"offload_bytes": 123 << 20}
    for name in ("plain", "peers", "offload"):
        suite.engine(suite.ENGINES[name], Path("/m"), cfg, "http://pool" if name == "peers" else None)
    plain, peers, offload = made
    assert "num_gpu_blocks_override" not in plain and "kv_transfer_config" not in plain
    assert peers["num_gpu_blocks_override"] == 500 and peers["enable_prefix_caching"]
    assert peers["kv_transfer_config"]["kv_connector"] == "KvpoolConnector"
    assert peers["kv_transfer_config"]["kv_connector_extra_config"]["mode"] == "resident"
    assert offload["num_gpu_blocks_override"] == 500 and offload["enable_prefix_caching"]
    assert offload["kv_transfer_config"] == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                             "kv_connector_extra_config": {"cpu_bytes_to_use": 123 << 20}}  # fmt: skip
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_engines_start_on_their_gpus_and_two_gpus_run_no_pair(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The suite's own loop with stand-ins for vLLM and the pool: where each engine started, what the pool was told,
    and which workloads each configuration ran."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    started: list[tuple[str, str, str | None]] = []
    pools: list[Any] = []
    calls: list[tuple[str, int, int]] = []

    def engine(config: suite.EngineConfig, model: Path, cfg: dict, url: str | None) -> str:
        name = next(n for n, c in suite.ENGINES.items() if c is config)
        started.append((name, os.environ["CUDA_VISIBLE_DEVICES"], url))
        return f"{name}-{sum(1 for s in started if s[0] == name)}"

    def generate(llm: str, batch: list, max_tokens: int, params: object = ()) -> dict:
        calls.append((llm, len(batch), max_tokens))
        n = len(batch)
        return {"ttft_ms": [1.0] * n, "tpot_ms": [1.0] * n, "tokens": [[1]] * n, "prompt_tokens": [256] * n,
                "cached": [0] * n, "kv_transfer_params": [{"x": 1}] * n}  # fmt: skip

    class Pool:
        """A pool whose books move with the requests (a writer's commits reach it at once) and stand still between
        them."""

        url = "http://pool.invalid"

        def __init__(self, flags: tuple[str, ...]) -> None:
            self.flags = flags
            pools.append(self)

        def stats(self) -> dict:
            done = len(calls)
            return {"counters": {"committed_blocks": 1000 * done, "hit_blocks": 48 * done, "peer_copies": done,
                                 "peer_copied_blocks": 48 * done}}  # fmt: skip

        def stop(self) -> None:
            pass

    monkeypatch.setattr(suite, "engine", engine)
    monkeypatch.setattr(suite, "generate", generate)
    monkeypatch.setattr(suite, "close", lambda llm: None)
    monkeypatch.setattr(suite.harness, "start_pool", lambda device, *flags: Pool(flags))
    monkeypatch.setattr(suite.Setup, "connector_counters", lambda self: {})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**suite.LLAMA_1B, "torch_dtype": "bfloat16"}))
    args = suite_parser("vllm").parse_args(["--quick", "--no-progress", "--engines", "plain,resident,peers,offload"])
    cfg = suite.config_of(args)
    assert cfg["gpus"] == {"plain": [0], "resident": [0, 0], "peers": [0, 1], "offload": [0, 1]}
    raw = suite.measure(args, cfg, model, machine.Device("cuda", 0))

    assert [(name, gpu) for name, gpu, _ in started] == [
        ("plain", "0"), ("resident", "0"), ("resident", "0"), ("peers", "0"), ("peers", "1"), ("offload", "0"),
        ("offload", "1"),
    ]  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert [url for name, _, url in started if name in ("plain", "offload")] == [None] * 3, "no pool"
    resident_pool, peers_pool = pools
    assert "--devices" not in resident_pool.flags
    assert peers_pool.flags[peers_pool.flags.index("--devices") + 1] == "0,1"
    assert peers_pool.flags[peers_pool.flags.index("--num-blocks") + 1] == str(cfg["pool_blocks"])
    for name in ("plain", "resident"):
        assert len(raw[name]["pair"]) == cfg["rounds"] and set(raw[name]["singles"]) == {"B", "P"}
    for name in ("peers", "offload"):
        assert "pair" not in raw[name] and set(raw[name]["singles"]) == {"B"}
        assert not [c for c in calls if c[0].startswith(name) and c[2] == 1], "no prefill of one token: no pair"
        readers = [c for c in calls if c[0] == f"{name}-2"]
        assert len(readers) == 2 + cfg["rounds"] + cfg["singles"], (
            "B: the warm-ups (a burst, a lone one), each round, each single"
        )
    pool = raw["peers"]["prefix"]["burst"][0]["pool"]
    assert set(pool) == {"committed_by_A", "committed_by_B", "hit_blocks_B", "peer_copies_B", "peer_copied_blocks_B"}
    assert (pool["peer_copies_B"], pool["peer_copied_blocks_B"]) == (1, 48), "counted around B's one generate"
    assert "pool" not in raw["offload"]["prefix"]["burst"][0]


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


def report_of(raw: dict, tmp_path: Path, **config: Any) -> harness.Report:
    args = argparse.Namespace(out=tmp_path, tag="", metadata=[])
    cfg = {"engines": list(raw), "requests": 2, "prompt_len": 8, "prefix_len": 4, "block_size": 4, "new_tokens": 2,
           "rounds": 1, "cuda_graphs": True, "vllm": "0.26.0", **config}  # fmt: skip
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


def recorded_on_two_gpus() -> dict:
    """plain and cold on one GPU; peers and offload on two, with no pair and B alone one at a time."""
    raw = recorded()
    del raw["copy"]
    a, b = [1, 2], [1, 3]
    copied = {"committed_by_A": 4, "committed_by_B": 2, "hit_blocks_B": 2, "peer_copies_B": 2,
              "peer_copied_blocks_B": 2}  # fmt: skip
    peers_burst = run([50.0, 60.0], [a, b], [6, 6]) | {"pool": copied}
    raw["peers"] = {"start_s": 1.0, "prefix": {"burst": [peers_burst]}, "singles": {"B": [run([9.0], [a], [4])]},
                    "connector": {"writer": {"copied_blocks": 0, "installed_blocks": 4},
                                  "reader": {"copied_blocks": 0, "installed_blocks": 2}}}  # fmt: skip
    raw["offload"] = {"start_s": 1.0, "prefix": {"burst": [run([100.0, 120.0], [a, b])]},
                      "singles": {"B": [run([12.0], [a])]}, "connector": {}}  # fmt: skip
    return raw


def test_two_gpus_have_no_pair_rows_and_are_compared_with_cold_and_offload(tmp_path: Path) -> None:
    report = report_of(recorded_on_two_gpus(), tmp_path)
    rows = {(r["engine"], r["workload"]): r for r in report.results}
    assert {w for e, w in rows if e in ("peers", "offload")} == {"prefix burst", "single B"}, "no empty row"
    burst = rows["peers", "prefix burst"]
    assert (burst["ttft_p50_vs_cold"], burst["ttft_p50_vs_offload"], burst["same_tokens_as_plain"]) == (0.5, 0.5, "2/2")
    assert burst["pool"][0]["peer_copied_blocks_B"] == 2
    assert rows["offload", "prefix burst"]["ttft_p50_vs_offload"] == 1.0
    assert (
        rows["plain", "pair decode"]["ttft_p50_vs_cold"] == 1.0
        and "ttft_p50_vs_offload" not in rows["plain", "pair decode"]
    )
    got = {t.name: t for t in report.targets}
    assert sorted(got) == [
        "peers: blocks copied between vLLM's cache and the arena",
        "peers: each prefix copied to the other GPU once (B's shared blocks are A's, copied between arenas)",
        "peers: greedy tokens one request at a time as vLLM's own cache (prefix computed on the other GPU)",
        "peers: prefix computed on the other GPU: burst TTFT p50 / cold",
        "peers: prefix computed on the other GPU: burst TTFT p50 / vLLM's CPU offloading connector",
    ], "offload, plain and cold are what peers is measured against; the pair's targets need a pair"
    tokens = got["peers: greedy tokens one request at a time as vLLM's own cache (prefix computed on the other GPU)"]
    assert (tokens.goal, tokens.measured, tokens.met) == ("identical", "B 1/1", True)
    cold = got["peers: prefix computed on the other GPU: burst TTFT p50 / cold"]
    assert (cold.goal, cold.measured, cold.met, cold.detail) == (
        "<= 0.7x",
        "0.50x",
        True,
        "vLLM's CPU offloading connector 1.00x",
    )
    offload = got["peers: prefix computed on the other GPU: burst TTFT p50 / vLLM's CPU offloading connector"]
    assert (offload.goal, offload.measured, offload.met, offload.detail) == (
        "lower",
        "0.50x",
        True,
        "55.0 against 110.0 ms",
    )
    once = got["peers: each prefix copied to the other GPU once (B's shared blocks are A's, copied between arenas)"]
    assert (once.goal, once.measured, once.met, once.detail) == ("2 a round", "2", True, "for 2 lookups; hits 2")
    zero = got["peers: blocks copied between vLLM's cache and the arena"]
    assert (zero.measured, zero.met) == ("0 (6 installed by id)", True)


def test_a_prefix_computed_again_on_the_other_gpu_misses_its_targets(tmp_path: Path) -> None:
    """No block copied between the GPUs, and the reader as slow as cold: the targets say so."""
    raw = recorded_on_two_gpus()
    (burst,) = raw["peers"]["prefix"]["burst"]
    burst["ttft_ms"] = [100.0, 140.0]
    burst["pool"] |= {"hit_blocks_B": 0, "peer_copies_B": 0, "peer_copied_blocks_B": 0}
    raw["peers"]["singles"]["B"] = [run([9.0], [[5, 5]], [4])]
    del raw["offload"]
    got = {t.name: t for t in report_of(raw, tmp_path).targets}
    assert not any("offloading" in name for name in got), "no offload run: no comparison with it"
    cold = got["peers: prefix computed on the other GPU: burst TTFT p50 / cold"]
    assert (cold.measured, cold.met, cold.detail) == ("1.09x", False, "")
    once = got["peers: each prefix copied to the other GPU once (B's shared blocks are A's, copied between arenas)"]
    assert (once.measured, once.met) == ("0", False)
    tokens = got["peers: greedy tokens one request at a time as vLLM's own cache (prefix computed on the other GPU)"]
    assert (tokens.measured, tokens.met) == ("B 0/1", False)


def test_the_block_of_two_gpus_names_where_the_engines_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = report_of(recorded_on_two_gpus(), tmp_path, gpus={"plain": [0], "cold": [0], "peers": [0, 1],
                                                              "offload": [0, 1]})  # fmt: skip
    report.print_block("vllm", suite.body(report))
    out = capsys.readouterr().out
    assert "on two GPUs (writer, reader): peers 0 and 1, offload 0 and 1" in out
    assert "/ offload" in out and "peers    prefix burst" in out and "pair" in out
    assert "peers    pair" not in out and "peers    single P" not in out
    json_path, _ = report.save(lambda: suite.plot(report))
    assert json.loads(json_path.read_text())["raw"]["peers"]["prefix"]["burst"][0]["pool"]["peer_copies_B"] == 2
