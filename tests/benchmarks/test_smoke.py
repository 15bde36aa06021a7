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

ROOT = Path(__file__).resolve().parents[2]

TINY: dict[str, list[str]] = {
    "control-plane": ["--batches", "1,8", "--clients", "1,2", "--rounds", "1", "--chunk-s", "0.02"],
    "handoff": ["--sizes", "1MiB,2MiB", "--rounds", "1", "--claim-lead-ms", "2"],
    "attach": ["--sizes", "16MiB", "--rounds", "1"],
    "prefix": ["--tokens", "512", "--rounds", "1"],
    "e2e": ["--scenarios", "1,3", "--rates", "20", "--duration-s", "0.2", "--min-requests", "3", "--prompt-len", "40"],
    "copy": ["--sizes", "2MiB", "--rounds", "1"],
}
RESULT_KEYS = {"suite", "timestamp", "command", "config", "device", "versions", "git", "results", "targets", "raw"}


@pytest.mark.parametrize("suite", list(TINY))
def test_suite_runs_and_writes_json_and_png(suite: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
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
