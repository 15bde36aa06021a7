"""Start ``kvpool serve`` with exactly the flags a test gives (``start_pool`` always passes --socket/--port)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import ROOT, PoolProcess

SMALL_LAYOUT = (
    "--num-blocks", "64", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32",
)  # fmt: skip


def serve(
    flags: list[str],
    *,
    port: int,
    socket: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout_s: float = 60.0,
) -> PoolProcess:
    """Run ``kvpool serve <flags>``; ``port`` and ``socket`` are where the test expects it (not passed for it).

    With ``wait``, return once ``/health`` on the port answers 200; otherwise return at once (for a pool that
    is expected to refuse to start).
    """
    log = Path(tempfile.mkdtemp(prefix="kvp-log-")) / "pool.log"
    args = [sys.executable, "-m", "kvpool", "serve", "--backend", "cpu", "--log-level", "warning", *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    full_env = {**clean, "PYTHONPATH": str(ROOT), **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    pool = PoolProcess(proc, socket, port, log, args)
    if not wait:
        return pool
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pool exited with {proc.returncode}:\n{pool.output()}")
        try:
            if httpx.get(f"{pool.tcp_url}/health", timeout=1).status_code == 200:
                return pool
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pool.stop()
    raise RuntimeError(f"pool not healthy after {timeout_s}s:\n{pool.output()}")
