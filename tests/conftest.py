"""Shared fixtures: a real pool server in a subprocess, and the GPU marker's skip."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this repo first on PYTHONPATH, anything already there kept."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PoolProcess:
    """A ``kvpool serve`` subprocess; ``url`` is its Unix socket, ``tcp_url`` its loopback port."""

    proc: subprocess.Popen[bytes]
    socket: Path
    port: int
    log: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.tcp_url, headers=headers, timeout=30)

    def stats(self, token: str | None = None) -> dict:
        with self.http(token) as h:
            return h.get("/stats").json()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_pool(*flags: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> PoolProcess:
    """Start a real pool on a fresh socket and port and wait until ``/health`` answers 200."""
    workdir = Path(tempfile.mkdtemp(prefix="kvp-"))
    sock, port, log = workdir / "kvpool.sock", free_port(), workdir / "pool.log"
    args = [sys.executable, "-m", "kvpool", "serve", "--socket", str(sock), "--port", str(port)]
    args += ["--backend", "cpu", "--log-level", "warning", *flags]
    return launch(args, sock, port, log, child_env(**(env or {})), timeout_s=timeout_s)


def launch(
    args: list[str], sock: Path, port: int, log: Path, env: dict[str, str], wait: bool = True, timeout_s: float = 60.0
) -> PoolProcess:
    """Run a pool command line; with ``wait``, return once ``/health`` on ``port`` answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    pool = PoolProcess(proc, sock, port, log, args)
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
    pool.stop(signal.SIGKILL)
    raise RuntimeError(f"pool not healthy after {timeout_s}s:\n{pool.output()}")


@pytest.fixture
def pool_server() -> Iterator[PoolProcess]:
    """A pool of 64 small blocks (2 layers, 2 heads, head dim 8, block size 4, float32)."""
    pool = start_pool(*SMALL_POOL)
    yield pool
    pool.stop()
    shutil.rmtree(pool.socket.parent, ignore_errors=True)


SMALL_POOL = (
    "--num-blocks", "64", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32", "--lease-ttl-s", "5",
)  # fmt: skip
