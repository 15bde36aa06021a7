"""The VMM arena on a real GPU: 64 GiB mapped by fresh processes, processes in PID namespaces of their own sharing
it, and a process that was not handed the fd unable to map it.

The timings printed here are for reading, not asserted: ``kvpool bench attach`` measures attach time properly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.server.launch import ServerProcess
from tests.conftest import child_env, free_port, start_pool

pytestmark = pytest.mark.gpu

GIB = 1 << 30
#: 2 MiB blocks (32 layers, 8 KV heads, head dim 128, bf16, 16 tokens): 32768 of them in 64 GiB
BIG_LAYOUT = ("--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--block-size", "16",
              "--dtype", "bfloat16")  # fmt: skip
SMALL = ("--num-blocks", "256", "--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64", "--block-size", "16",
         "--dtype", "bfloat16")  # fmt: skip
#: a PID namespace of its own, with its own /proc; the process in it is PID 1, and it dies with unshare
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
TOKEN = "vmm-test-token"


def unshare_works() -> str | None:
    """None if this process may put children in PID namespaces of their own; else why not."""
    if os.geteuid() != 0:
        return "PID namespaces need root here (unshare -p)"
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"unshare failed: {probe.stderr.strip()}"


def worker(*args: str, namespaced: bool = False, token: str | None = None) -> dict:
    env = child_env(**({"KVPOOL_TOKEN": token} if token else {}))
    if token is None:
        env.pop("KVPOOL_TOKEN", None)
    cmd = [*(UNSHARE if namespaced else []), sys.executable, "-m", "tests.gpu.vmm_worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_pool_side_releases_what_it_created_and_the_fd_maps_the_same_memory():
    from kvpool import vmm
    from kvpool.cuda import DeviceBuffer
    from kvpool.server.arenas import VmmOwnedArena

    torch.cuda.init()
    warm = torch.empty(16, dtype=torch.uint8, device="cuda:0")  # kernels load lazily and take device memory
    warm[-8:].fill_(7)
    assert warm[-8:].tolist() == [7] * 8
    del warm
    torch.cuda.synchronize()
    before, _ = torch.cuda.mem_get_info(0)
    arena = VmmOwnedArena(4 * GIB + 1, 0)
    try:
        assert arena.nbytes % vmm.granularity(0) == 0 and arena.nbytes >= 4 * GIB + 1
        assert torch.cuda.mem_get_info(0)[0] <= before - 4 * GIB
        ptrs = [vmm.import_map(os.dup(arena.fd), arena.nbytes, 0) for _ in range(2)]
        one, two = (torch.as_tensor(DeviceBuffer(p, arena.nbytes), device="cuda:0") for p in ptrs)
        one[-8:].fill_(7)
        torch.cuda.synchronize()
        assert ptrs[0] != ptrs[1] and two[-8:].tolist() == [7] * 8  # two mappings, one memory
        del one, two
        for p in ptrs:
            vmm.unmap(p, arena.nbytes)
    finally:
        arena.close()
    assert arena.fd is None and arena.alloc == 0
    assert torch.cuda.mem_get_info(0)[0] >= before - 64 * (1 << 20)


def test_the_driver_names_and_counts_the_gpus_as_torch_does():
    """The VMM attach asks the driver which GPU holds the arena, and which GPUs may reach it; it must agree with
    torch on every visible GPU, or the attach would fall back to torch's slower answer (or, worse, map another GPU
    or grant a GPU torch does not see)."""
    from kvpool import cuda, vmm

    count = torch.cuda.device_count()
    for index in range(count):
        assert vmm.ordinal_of(cuda.device_uuid(index)) == index
        others = [o for o in range(count) if o != index and torch.cuda.can_device_access_peer(o, index)]
        assert vmm.peers(index) == [index, *others]
    assert vmm.ordinal_of("00000000-0000-0000-0000-000000000000") is None


def test_a_64_gib_vmm_arena_is_mapped_by_fresh_processes_one_writing_what_the_other_reads():
    free, _ = torch.cuda.mem_get_info(0)
    if free < 66 * GIB:
        pytest.skip(f"needs 66 GiB of free GPU memory, {free / GIB:.1f} GiB free")
    pool = start_pool("--backend", "cuda", "--arena-handle", "vmm", "--arena-bytes", "64GiB", *BIG_LAYOUT,
                      timeout_s=300)  # fmt: skip
    try:
        with PoolClient(pool.url, name="vmm-64") as client:
            desc = client.descriptor()
        assert (desc.handle_kind, desc.handle, desc.nbytes) == ("vmm", "vmm:0", 64 * GIB)
        w = worker("write", pool.url, "req-64")
        r = worker("read", pool.url, "req-64")
        assert w["kind"] == "vmm" and r["read_ok"] and r["blocks"] == w["blocks"]
        assert w["blocks"] == [0, desc.num_blocks - 1]
        print(f"\n64 GiB VMM arena: mapped and touched in {w['map_ms']:.2f} ms (writer), {r['map_ms']:.2f} ms (reader)")
    finally:
        pool.stop()
    assert pool.proc.returncode == 0


@pytest.fixture(scope="module")
def namespaced_pool() -> Iterator[ServerProcess]:
    """A VMM pool that is PID 1 in a PID namespace of its own, with a token."""
    why = unshare_works()
    if why is not None:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="kvp-ns-"))
    sock, port = workdir / "kvpool.sock", free_port()
    args = [*UNSHARE, sys.executable, "-m", "kvpool", "serve", "--socket", str(sock), "--port", str(port),
            "--backend", "cuda", "--arena-handle", "vmm", "--token", TOKEN, "--log-level", "warning",
            *SMALL]  # fmt: skip
    log = workdir / "pool.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env())
    pool = ServerProcess(proc, sock, port, log, args, workdir)
    pool.wait_ready(120)
    yield pool
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        os.kill(int(child), signal.SIGTERM)  # the pool itself, so that it shuts down as it would in a container
    pool.stop()


def test_processes_in_pid_namespaces_of_their_own_share_the_vmm_arena(namespaced_pool):
    url = namespaced_pool.url
    w = worker("write", url, "req-ns", namespaced=True, token=TOKEN)
    r = worker("read", url, "req-ns", namespaced=True, token=TOKEN)
    # the pool and both workers are PID 1, each in its own namespace: where a legacy handle fails to open
    assert (w["pid"], w["pool_pid"], r["pid"], r["pool_pid"]) == (1, 1, 1, 1)
    assert w["kind"] == "vmm" and r["read_ok"]
    print(f"\nseparate PID namespaces, all PID 1: writer mapped in {w['map_ms']:.2f} ms, reader {r['map_ms']:.2f} ms")


def test_a_process_that_was_not_handed_the_fd_cannot_map_the_arena(namespaced_pool):
    with PoolClient(namespaced_pool.url, name="describer", token=TOKEN) as client:
        descriptor = client.descriptor().model_dump_json()
    out = worker("stranger", namespaced_pool.url, descriptor, TOKEN, namespaced=True)
    assert out["descriptor_alone"].startswith("refused")
    assert out["wrong_token"] == {"hello": 401, "arena_fd": 401, "fd": None}
    assert out["session_without_token"] == "refused"
    assert out["imported_by_number"] == []
    assert out["with_token"] == "vmm"  # the same process maps it once the pool hands it the fd
    print(f"\nstranger: {json.dumps(out)}")
