"""The ``kvpool`` command as a newcomer meets it: clean stops, one-line errors, defaults that work together."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client import PoolClient
from kvpool.server.launch import SOURCE_ROOT, ServerProcess, child_env, spawn
from kvpool.server.shm import filesystem_of
from tests.conftest import cuda_available, free_port

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
    with tempfile.TemporaryDirectory(prefix="kvp-cli-", dir="/dev/shm") as tmp:  # serve's --shm-dir must be tmpfs
        yield Path(tmp)


def test_version() -> None:
    done = kvpool("--version")
    assert done.returncode == 0
    assert done.stdout.strip().startswith("kvpool ") and done.stdout.split()[1][0].isdigit()


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_with_fast_channel_clients_connected_logs_no_error(workdir: Path, sig: signal.Signals) -> None:
    """One client idle on its fast connection, another waiting in a claim there: the stop ends both quietly."""
    pool = serve(workdir)
    idle, waiter = PoolClient(pool.url, name="idle"), PoolClient(pool.url, name="waiter")
    try:
        idle.free(idle.alloc(2))
        assert idle.transport.fast_path is not None and waiter.transport.fast_path is not None

        def wait_in_a_claim() -> None:
            with contextlib.suppress(Exception):  # the stopping pool answers it, or its connection ends
                waiter.claim("never", timeout_s=60)

        claim = threading.Thread(target=wait_in_a_claim)
        claim.start()
        deadline = time.monotonic() + 30
        while pool.stats()["claims_waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.stats()["claims_waiting"] == 1
        pool.proc.send_signal(sig)
        assert pool.proc.wait(timeout=30) == 0
        claim.join(timeout=30)
    finally:
        for client in (idle, waiter):
            with contextlib.suppress(Exception):
                client.close()
    log = pool.output()
    assert "Traceback" not in log and "ERROR" not in log and "CancelledError" not in log, log
    assert f"stopped by {sig.name}" in log


@pytest.mark.slow
@pytest.mark.skipif(cuda_available(), reason="the point is a machine without CUDA")
def test_a_cuda_only_setting_on_a_machine_without_cuda_is_one_line_before_anything_starts(workdir: Path) -> None:
    """The README's "Running the pool" on a laptop: refused before the pool logs that it listens."""
    sock = workdir / "kvpool.sock"
    done = kvpool("serve", "--gpu-memory-fraction", "0.5", "--socket", str(sock), "--port", "0")
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("kvpool serve: --gpu-memory-fraction (KVPOOL_GPU_MEMORY_FRACTION) ")
    assert line.endswith("give --num-blocks N or --arena-bytes SIZE instead")
    assert "listening" not in done.stdout + done.stderr and not sock.exists()


@pytest.mark.slow
def test_a_bad_value_is_two_lines_naming_the_allowed_ones() -> None:
    for argv in (
        ["serve", "--dtype", "int4"],
        ["bench", "prefix", "--device", "tpu"],
        ["demo", "--dtype", "int4"],
        ["health", "--timeout", "soon"],
    ):
        done = kvpool(*argv)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 2 and "usage:" not in done.stderr, done.stderr
        assert "invalid" in lines[0] and "--help lists the options" in lines[1]
    assert "'bf16'" in kvpool("serve", "--dtype", "int4").stderr


@pytest.mark.slow
def test_serve_help_comes_in_sections() -> None:
    done = kvpool("serve", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: kvpool serve [options]\n")
    for section in ("arena and layout:", "network and security:", "sessions and limits:", "KV events"):
        assert f"\n{section}" in done.stdout
    assert "--num-blocks N" in done.stdout and "[1024 when no size is given;" in " ".join(done.stdout.split())


@pytest.mark.slow
def test_bench_help_is_plain_text_with_the_suites() -> None:
    done = kvpool("bench", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: kvpool bench SUITE [options]")
    assert "``" not in done.stdout
    for suite in ("control-plane", "e2e", "vllm", "decode"):
        assert f"\n  {suite} " in done.stdout
    unknown = kvpool("bench", "nonesuch")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 2, unknown.stderr


@pytest.mark.slow
def test_the_demo_says_what_it_does_as_it_goes(workdir: Path) -> None:
    """Progress lines come while the demo runs (the pool up, the workers up, each request done), not all at the end;
    the table's columns hold one kind of value each."""
    clean = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    with (workdir / "stderr").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "demo", "--max-new-tokens", "4"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=clean, cwd=SOURCE_ROOT)  # fmt: skip
        assert proc.stdout is not None
        arrived = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
        assert proc.wait(timeout=120) == 0, (workdir / "stderr").read_text()
    lines = [line for _, line in arrived]
    header = next(i for i, line in enumerate(lines) if line.startswith("request "))
    assert lines[0].startswith("kvpool demo: starting a pool") and lines[1].startswith("pool up: ")
    assert any(line.startswith("workers up: ") for line in lines[2:header])
    assert sorted(line.split()[0] for line in lines[:header] if " done: " in line) == [f"req-{i}" for i in range(6)]
    assert arrived[header][0] - arrived[1][0] > 1.0, "the progress came all at once, with the table"
    assert lines[header].split()[-3:] == ["monolithic", "first", "tokens"]
    rows = lines[header + 1 : header + 7]
    assert all(row.split()[6] == "same" and row.split()[7].startswith("[") for row in rows), rows


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_socket_whose_directory_cannot_be_made_is_one_line(workdir: Path) -> None:
    (workdir / "file").write_text("")
    sock = workdir / "file" / "kvpool.sock"
    done = kvpool("serve", "--socket", str(sock), "--port", "0", "--backend", "cpu", "--shm-dir", str(workdir))
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith(f"kvpool serve: --socket {sock}: cannot create its directory {sock.parent} ("), line


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--arena-bytes", "100TiB"], "make the arena smaller (--num-blocks, --arena-bytes)"),
        (["--host-bytes", "100TiB"], "make the host tier smaller (--host-blocks, --host-bytes)"),
    ],
    ids=["arena", "host-tier"],
)
@pytest.mark.slow
def test_an_arena_or_host_tier_larger_than_the_shm_dir_is_one_line_before_listening(
    workdir: Path, flags: list[str], names: str
) -> None:
    sock = workdir / "kvpool.sock"
    done = kvpool("serve", "--socket", str(sock), "--port", "0", "--backend", "cpu", "--shm-dir", str(workdir), *flags)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("kvpool serve: the ") and f"--shm-dir {workdir} has " in line and names in line, line
    assert "listening" not in done.stdout + done.stderr and not sock.exists()


@pytest.mark.slow
def test_a_shm_dir_that_does_not_exist_is_refused_not_created(workdir: Path) -> None:
    typo = workdir / "shm-typo"
    done = kvpool("serve", "--socket", str(workdir / "s.sock"), "--port", "0", "--backend", "cpu",
                  "--shm-dir", str(typo))  # fmt: skip
    assert done.returncode == 2
    assert one_line(done).startswith(f"kvpool serve: --shm-dir {typo} (KVPOOL_SHM_DIR) is not a directory: ")
    assert not typo.exists()


@pytest.mark.slow
def test_a_shm_dir_on_disk_is_refused() -> None:
    with tempfile.TemporaryDirectory(prefix="kvp-cli-disk-", dir=SOURCE_ROOT) as tmp:
        kind = filesystem_of(Path(tmp))
        if kind in (None, "tmpfs", "ramfs"):
            pytest.skip(f"the checkout is on {kind}, not on a disk")
        done = kvpool("serve", "--socket", str(Path(tmp) / "s.sock"), "--port", "0", "--backend", "cpu",
                      "--shm-dir", tmp)  # fmt: skip
        assert done.returncode == 2
        assert one_line(done) == (
            f"kvpool serve: --shm-dir {tmp} (KVPOOL_SHM_DIR) is on {kind}, not tmpfs: the KV would be a file on "
            "disk; give a tmpfs directory such as /dev/shm"
        )
        assert list(Path(tmp).iterdir()) == []


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "23 22 0:5 / /dev/shm rw - tmpfs tmpfs rw\n"
        "24 22 0:6 / /dev/shm\\040x rw - xfs /dev/sdb rw\n"
    )
    assert filesystem_of(Path("/dev/shm/kvp"), info) == "tmpfs"
    assert filesystem_of(Path("/dev/shmx"), info) == "ext4"
    assert filesystem_of(Path("/dev/shm x/y"), info) == "xfs"
    assert filesystem_of(Path("/"), tmp_path / "none") is None


@pytest.mark.slow
def test_invalid_settings_are_one_line() -> None:
    done = kvpool("serve", "--num-blocks", "0", env={"KVPOOL_LEASE_TTL_S": "-1"})
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("kvpool serve: invalid settings: ")
    assert "--num-blocks (KVPOOL_NUM_BLOCKS)" in line and "--lease-ttl-s (KVPOOL_LEASE_TTL_S)" in line


@pytest.mark.slow
def test_info_without_a_pool_is_one_line(workdir: Path) -> None:
    url = f"unix://{workdir / 'nobody.sock'}"
    done = kvpool("info", env={"KVPOOL_URL": url})
    assert done.returncode == 1
    assert one_line(done).startswith(f"kvpool info: no pool answers at {url} ")
    assert "kvpool serve" in done.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_default_worker_fits_the_default_pool(workdir: Path) -> None:
    with serve(workdir) as pool:
        request = json.dumps({"request_id": "r0", "prompt": list(range(20)), "max_new_tokens": 2})
        done = kvpool("worker", "prefill", "--random-model", "--pool", pool.url, stdin=request + "\n")
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert record["request_id"] == "r0" and "error" not in record


@pytest.mark.slow
def test_a_worker_that_does_not_fit_says_which_flags_to_set(workdir: Path) -> None:
    with serve(workdir, "--num-kv-heads", "4", "--head-dim", "64") as pool:
        done = kvpool("worker", "prefill", "--random-model", "--pool", pool.url)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("kvpool worker prefill: the arena's KV layout does not fit the model")
    assert "start the pool with --num-kv-heads 2 --head-dim 32" in line
