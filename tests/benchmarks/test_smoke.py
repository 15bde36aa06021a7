"""Each benchmark suite runs end to end with tiny sizes, exits 0, and writes its JSON and PNG.

A smoke test, never a timed one: nothing here asserts on a figure, only that the harness works (CLI, real
servers and worker processes, the result file's keys), so that a suite cannot rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.errors import InvalidRequest
from kvpool.server.remote.nixlagent import load_nixl

ROOT = Path(__file__).resolve().parents[2]

E2E = ["--scenarios", "1,3,4", "--rates", "20", "--duration-s", "0.2", "--min-requests", "3", "--prompt-len", "40"]
TINY: dict[str, list[str]] = {
    "control-plane": ["--batches", "1,8", "--clients", "1,2", "--rounds", "1", "--chunk-s", "0.02"],
    "handoff": ["--sizes", "1MiB,2MiB", "--rounds", "1", "--claim-lead-ms", "2"],
    "attach": ["--sizes", "16MiB", "--rounds", "1"],
    "prefix": ["--tokens", "512", "--rounds", "1"],
    "e2e": [*E2E, "--host-factor", "2", "--host-passes", "2", "--host-rates", "40"],
    "copy": ["--sizes", "2MiB", "--rounds", "1"],
    "host-tier": ["--sizes", "2MiB", "--rounds", "1", "--layout", "1b"],
    "slab": ["--count", "20", "--rounds", "1", "--batch", "64", "--handoff-blocks", "4"],
    "decode": ["--batch", "2", "--context", "32", "--steps", "2"],
    "flood": ["--connections", "4", "--calls", "20", "--pipelined", "100"],
    "remote": ["--blocks", "2", "--rounds", "1"],
}
RESULT_KEYS = {"suite", "timestamp", "command", "config", "device", "versions", "git", "results", "targets", "raw"}

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'


def _has_nixl() -> bool:
    try:
        load_nixl()
    except InvalidRequest:
        return False
    return True


NEEDS = {"remote": pytest.mark.skipif(not _has_nixl(), reason="NIXL is not installed (kvpool[nixl])")}


@pytest.mark.parametrize("suite", [pytest.param(s, marks=NEEDS.get(s, ())) for s in TINY])
def test_suite_runs_and_writes_json_and_png(suite: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvpool.benchmarks",
        suite,
        "--quick",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--tag",
        "smoke",
        *TINY[suite],
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert " Result =" in proc.stdout

    (json_path,) = tmp_path.glob(f"{suite}-smoke-*.json")
    (png_path,) = tmp_path.glob(f"{suite}-smoke-*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(json_path.read_text())
    assert set(result) >= RESULT_KEYS
    assert result["suite"] == suite
    assert {"python", "torch", "kvpool"} <= set(result["versions"])
    assert "revision" in result["git"]
    assert result["device"]["kind"] == "cpu"
    assert result["results"], "no figures recorded"
    assert result["targets"], "no targets checked"


def run_bench(argv: list[str], tmp_path: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m kvpool.benchmarks ARGV``, after ``prelude`` (Python run first in the same process)."""
    code = f"{prelude}\nimport runpy\nrunpy.run_module('kvpool.benchmarks', run_name='__main__', alter_sys=True)"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env={**env, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip


def test_soak_shows_progress_and_writes_json_and_png_like_every_suite(tmp_path: Path) -> None:
    argv = ["soak", "--duration", "2", "--clients", "4", "--crash-every", "0", "--out", str(tmp_path), "--tag", "t"]
    proc = run_bench(argv, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "soak (s)" in proc.stderr, "no progress shown"
    (json_path,) = tmp_path.glob("soak-t-*.json")
    (png_path,) = tmp_path.glob("soak-t-*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(json_path.read_text())
    assert set(result) >= RESULT_KEYS and result["suite"] == "soak"
    assert result["command"].split(" ", 1)[1] == "-m kvpool.benchmarks " + " ".join(argv)
    assert {r["op"] for r in result["results"]} >= {"alloc", "free", "claim"}


BLOCK_EXTRAS = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"tqdm", "matplotlib"}:
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _Absent())
"""


def test_bench_runs_without_the_bench_extra(tmp_path: Path) -> None:
    proc = run_bench(["prefix", "--quick", "--device", "cpu", "--out", str(tmp_path), *TINY["prefix"]], tmp_path,
                     prelude=BLOCK_EXTRAS)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prefix: " in proc.stderr, "no plain progress lines"
    assert "no PNG: matplotlib is not installed" in proc.stdout
    assert len(list(tmp_path.glob("prefix-*.json"))) == 1 and not list(tmp_path.glob("*.png"))


def test_rates_keep_three_figures() -> None:
    from kvpool.benchmarks.harness import fmt_rate

    assert [fmt_rate(x) for x in (1_764_000, 412_345, 950, 12.5, 0.25)] == ["1.76M", "412k", "950", "12.5", "0.25"]
