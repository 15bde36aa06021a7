"""Starting a server process for tests and benchmarks: one that cannot start leaves nothing behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvpool.server.launch import child_env, spawn


@pytest.mark.slow
def test_a_server_that_exits_at_start_says_why_and_its_work_directory_goes() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvp-launch-"))
    sock = workdir / "s.sock"
    args = ["kvpool", "serve", "--backend", "cpu", "--port", "0", "--socket", str(sock), "--num-blocks", "0"]
    with pytest.raises(RuntimeError, match="--num-blocks"):
        spawn(args, socket=sock, port=0, log=workdir / "pool.log", env=child_env(), timeout_s=60, workdir=workdir)
    assert not workdir.exists(), "a pool that failed to start left its work directory"
