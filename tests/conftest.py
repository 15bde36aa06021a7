"""Shared fixtures: a pool served in the test process, a real pool server in a subprocess, and the GPU marker's skip.

A test of what the pool answers takes ``pool_server`` (a :class:`LocalPool`: milliseconds to start); a test of what
only a process shows (a crash, a restart, a signal, a worker process of its own that reaches the pool) takes
``pool_process`` or calls :func:`start_pool`."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.server.launch import ServerProcess, child_env, spawn
from kvpool.server.transports.local import LocalPool

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PoolProcess = ServerProcess


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal lands asynchronously, and a thread
    still running on a loaded machine would answer one more call before it does."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} was sent SIGSTOP and still had a running thread after {timeout_s} s")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on the shared-memory tmpfs: the only kind ``kvpool serve --shm-dir`` accepts."""
    with tempfile.TemporaryDirectory(prefix="kvp-shm-", dir="/dev/shm") as tmp:
        yield Path(tmp)


def start_pool(
    *flags: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    preexec_fn: Callable[[], object] | None = None,
) -> PoolProcess:
    """Start a real pool on a fresh socket and port and wait until ``/health`` answers 200."""
    workdir = Path(tempfile.mkdtemp(prefix="kvp-"))
    sock, port = workdir / "kvpool.sock", free_port()
    args = ["kvpool", "serve", "--socket", str(sock), "--port", str(port), "--backend", "cpu", "--log-level", "warning"]
    return spawn([*args, *flags], socket=sock, port=port, log=workdir / "pool.log", env=child_env(**(env or {})),
                 timeout_s=timeout_s, workdir=workdir, preexec_fn=preexec_fn)  # fmt: skip


def local_pool(*flags: str) -> LocalPool:
    """A pool in this process, set as :func:`start_pool` sets its process: a fresh socket directory, no TCP port."""
    workdir = Path(tempfile.mkdtemp(prefix="kvp-"))
    args = ["--socket", str(workdir / "kvpool.sock"), "--port", "0", "--backend", "cpu", "--log-level", "warning"]
    return LocalPool.from_flags(*args, *flags, workdir=workdir)


@pytest.fixture
def pool_server() -> Iterator[LocalPool]:
    """A pool of 64 small blocks (2 layers, 2 heads, head dim 8, block size 4, float32), in this process."""
    pool = local_pool(*SMALL_POOL)
    yield pool
    pool.stop()


@pytest.fixture
def pool_process() -> Iterator[PoolProcess]:
    """The same pool as ``pool_server``, as a ``kvpool serve`` process."""
    pool = start_pool(*SMALL_POOL)
    yield pool
    pool.stop()


SMALL_POOL = (
    "--num-blocks", "64", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32", "--lease-ttl-s", "5",
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def no_client_left_open() -> Iterator[None]:
    """A client that a test leaves open keeps its heartbeat thread, which warns every few seconds once its pool is
    gone, until the test process ends: a module's clients are closed by the time its fixtures are torn down."""
    import threading
    import time

    def beating() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvpool-heartbeat-") and t.is_alive()}

    before = beating()
    yield
    deadline = time.monotonic() + 3.0  # a close joins its heartbeat for up to 2 s
    while (left := beating() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"clients left open, their heartbeats still running: {sorted(t.name for t in left)}"
