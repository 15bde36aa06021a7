"""The ``kvpool`` command as a newcomer meets it: clean stops, one-line errors, defaults that work together."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.server.launch import SOURCE_ROOT, ServerProcess, child_env, spawn
from tests.conftest import free_port

TOKEN = "newcomer-token"


def kvpool(*argv: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *argv], capture_output=True, text=True, input=stdin,
                          env={**clean, **(env or {})}, cwd=SOURCE_ROOT, timeout=120)  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The whole of stderr, which must be a single line and no traceback."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "pydantic.dev" not in done.stderr
    return lines[0]


def serve(workdir: Path, *flags: str, port: int = 0, env: dict[str, str] | None = None) -> ServerProcess:
    """``kvpool serve`` with the default layout, a small arena, its socket and shm file in ``workdir``."""
    sock = workdir / "kvpool.sock"
    args = ["kvpool.cli", "serve", "--socket", str(sock), "--port", str(port), "--backend", "cpu",
            "--shm-dir", str(workdir), "--num-blocks", "32", *flags]  # fmt: skip
    clean = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    return spawn(args, socket=sock, port=port, log=workdir / "pool.log", env={**clean, **(env or {})})


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvp-cli-") as tmp:
        yield Path(tmp)


def test_version() -> None:
    done = kvpool("--version")
    assert done.returncode == 0
    assert done.stdout.strip().startswith("kvpool ") and done.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_requested_stop_exits_0_and_leaves_nothing(workdir: Path, sig: signal.Signals) -> None:
    pool = serve(workdir, port=free_port())
    (shm,) = [p for p in workdir.iterdir() if p.name.startswith("kvpool-")]
    assert {p.name for p in workdir.iterdir()} == {"kvpool.sock", "kvpool.sock.fast", "pool.log", shm.name}
    pool.proc.send_signal(sig)
    assert pool.proc.wait(timeout=30) == 0
    assert [p.name for p in workdir.iterdir()] == ["pool.log"], "a socket or the arena file was left behind"
    log = pool.output()
    assert "Traceback" not in log and f"stopped by {sig.name}" in log


def test_port_in_use_is_one_line(workdir: Path) -> None:
    port = free_port()
    with serve(workdir, port=port):
        done = kvpool("serve", "--port", str(port), "--socket", str(workdir / "other.sock"), "--backend", "cpu")
    assert done.returncode == 1
    assert one_line(done) == (
        f"kvpool serve: 127.0.0.1:{port} is in use (another pool?): stop it, pick another --port, or --port 0 to "
        "serve the Unix socket only"
    )
    assert not (workdir / "other.sock").exists()


def test_invalid_settings_are_one_line() -> None:
    done = kvpool("serve", "--num-blocks", "0", env={"KVPOOL_LEASE_TTL_S": "-1"})
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("kvpool serve: invalid settings: ")
    assert "--num-blocks (KVPOOL_NUM_BLOCKS)" in line and "--lease-ttl-s (KVPOOL_LEASE_TTL_S)" in line


def test_info_without_a_pool_is_one_line(workdir: Path) -> None:
    url = f"unix://{workdir / 'nobody.sock'}"
    done = kvpool("info", env={"KVPOOL_URL": url})
    assert done.returncode == 1
    assert one_line(done).startswith(f"kvpool info: no pool answers at {url} ")
    assert "kvpool serve" in done.stderr


def test_info_takes_the_token_from_the_environment_and_hides_every_handle(workdir: Path) -> None:
    with serve(workdir, env={"KVPOOL_TOKEN": TOKEN}) as pool:
        url = {"KVPOOL_URL": pool.url}
        done = kvpool("info", env={**url, "KVPOOL_TOKEN": TOKEN})
        missing = kvpool("info", env=url)
        wrong = kvpool("info", "--token", "guess", env=url)
        shown = kvpool("info", "--show-handle", "--token", TOKEN, env=url)
    assert done.returncode == 0, done.stderr
    arena = json.loads(done.stdout)["arena"]
    handle = json.loads(shown.stdout)["arena"]["handle"]
    assert handle.startswith(str(workdir)) and handle not in done.stdout
    assert arena["handle"] == arena["arenas"][0]["handle"] == "<hidden: --show-handle>"
    assert missing.returncode == 1
    assert one_line(missing) == "kvpool info: the pool wants a token: pass --token or set KVPOOL_TOKEN"
    assert wrong.returncode == 1 and "refused the token" in one_line(wrong)


def test_the_default_worker_fits_the_default_pool(workdir: Path) -> None:
    with serve(workdir) as pool:
        request = json.dumps({"request_id": "r0", "prompt": list(range(20)), "max_new_tokens": 2})
        done = kvpool("worker", "prefill", "--random-model", "--pool", pool.url, stdin=request + "\n")
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert record["request_id"] == "r0" and "error" not in record


def test_a_worker_that_does_not_fit_says_which_flags_to_set(workdir: Path) -> None:
    with serve(workdir, "--num-kv-heads", "4", "--head-dim", "64") as pool:
        done = kvpool("worker", "prefill", "--random-model", "--pool", pool.url)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("kvpool worker prefill: the arena's KV layout does not fit the model")
    assert "start the pool with --num-kv-heads 2 --head-dim 32" in line
