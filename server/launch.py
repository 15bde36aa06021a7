"""Running a pool (or any server of this project) as a child process and waiting until it is ready.

The demo, the benchmarks and the tests all start real ``kvpool serve`` processes; so does a user's own launcher.
One place knows how: the environment a child needs to import this checkout, the log file, the readiness wait
on ``/health``, and a stop that escalates from SIGTERM to SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SOURCE_ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment, with the directory that holds ``kvpool`` first on PYTHONPATH (what was there kept)."""
    path = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class ServerProcess:
    """A server child process: where it listens (Unix socket and/or loopback port) and where it logs."""

    proc: subprocess.Popen[bytes]
    socket: Path | None
    port: int
    log: Path
    args: list[str] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def url(self) -> str:
        """The Unix socket when there is one, else the TCP port."""
        return f"unix://{self.socket}" if self.socket is not None else self.tcp_url

    @property
    def tcp_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def http(self, token: str | None = None, timeout_s: float = 30.0) -> httpx.Client:
        from kvpool.client import http_client

        return http_client(self.tcp_url if self.port else self.url, token, timeout_s)

    def stats(self, token: str | None = None) -> dict[str, Any]:
        with self.http(token) as h:
            stats: dict[str, Any] = h.get("/stats").json()
            return stats

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Stop it (``sig`` first, SIGKILL after ``timeout_s``); remove its work directory, if it has one."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.proc.returncode

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Return once ``/health`` answers 200; raise with the server's log if it exits or never gets there."""
        from kvpool.client import http_client

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.output()
                self.stop()  # its work directory goes, as a stopped server's does
                raise RuntimeError(f"{' '.join(self.args)} exited with {self.proc.returncode}:\n{log}")
            if self.socket is None or self.socket.exists():
                try:
                    with http_client(self.url, None, 2.0) as h:
                        if h.get("/health").status_code == 200:
                            return
                except (httpx.HTTPError, OSError):
                    pass
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        log = self.output()
        self.stop()
        raise RuntimeError(f"not ready after {timeout_s}s: {' '.join(self.args)}\n{log}")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(
    module_args: Sequence[str],
    *,
    socket: Path | None,
    port: int,
    log: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout_s: float = 60.0,
    workdir: Path | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> ServerProcess:
    """Run ``python -m <module_args>`` (which must listen where ``socket``/``port`` say) with its output in ``log``;
    ``preexec_fn`` runs in the child before it starts (to set its resource limits, say)."""
    args = [sys.executable, "-m", *module_args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env or child_env(),
            cwd=SOURCE_ROOT, preexec_fn=preexec_fn,
        )  # fmt: skip
    server = ServerProcess(proc, socket, port, log, args, workdir)
    if wait:
        server.wait_ready(timeout_s)
    return server
