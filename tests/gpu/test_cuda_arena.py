"""The CUDA backend on a real GPU: one IPC handle, two processes aliasing one allocation."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest
import torch

from kvpool.client import PoolClient
from tests.conftest import child_env, start_pool
from tests.test_client import run_direct_handoff, run_worker

pytestmark = pytest.mark.gpu

CUDA_POOL = (
    "--backend", "cuda", "--num-blocks", "256", "--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64",
    "--block-size", "16", "--dtype", "bfloat16",
)  # fmt: skip


@pytest.fixture
def cuda_pool():
    pool = start_pool(*CUDA_POOL)
    yield pool
    pool.stop()


def test_pattern_crosses_processes_on_the_cuda_arena(cuda_pool):
    w = run_worker("write", cuda_pool.url, "req-gpu", "9")
    assert w.returncode == 0, w.stderr
    r = run_worker("read", cuda_pool.url, "req-gpu", "9")
    assert r.returncode == 0 and "READ OK" in r.stdout, r.stdout + r.stderr


def test_a_direct_handoff_crosses_processes_on_the_cuda_arena(cuda_pool):
    run_direct_handoff(cuda_pool.url, "req-gpu-direct", 9, "gpu-reader", timeout_s=120)
    assert cuda_pool.stats()["in_use"] == 0


def test_block_table_is_enqueued_on_the_device_from_packed_ids(cuda_pool):
    from array import array

    with PoolClient(cuda_pool.url, name="table") as pool:
        arena = pool.arena()
        ids = array("q", pool.alloc(5))
        table = arena.block_table(ids)
        torch.cuda.current_stream().synchronize()
        assert table.device == arena.device and table.dtype == torch.int32 and table.tolist() == arena.local_ids(ids)
        pool.free(ids)


def test_two_processes_alias_one_allocation_both_ways(cuda_pool):
    with PoolClient(cuda_pool.url, name="alias-test") as pool:
        desc = pool.descriptor()
        assert desc.backend == "cuda" and len(base64.b64decode(desc.handle)) == 64
        assert desc.device is not None and desc.device.uuid
        arena = pool.arena()
        assert arena.device.type == "cuda" and arena.raw.numel() == desc.nbytes
        peer = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.alias_worker", cuda_pool.url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        try:
            assert peer.stdout is not None and peer.stdin is not None
            opened = peer.stdout.readline()
            assert opened.startswith("OPENED"), opened
            mib, ms = desc.nbytes / 2**20, opened.split()[1]
            print(f"\nhandle: 64 bytes; a fresh process opened the {mib:.0f} MiB arena in {ms} ms")
            peer.stdin.write("write 2 17 1.25\n")
            peer.stdin.flush()
            assert peer.stdout.readline().strip() == "DONE"
            assert float(arena.k(2)[17].float().mean()) == 1.25  # the peer's write, seen here
            arena.k(3)[200].fill_(-4.0)
            torch.cuda.synchronize()
            peer.stdin.write("read 3 200 0\n")
            peer.stdin.flush()
            assert peer.stdout.readline().split() == ["VALUE", "-4.0"]  # our write, seen there
        finally:
            peer.stdin.close()
            peer.wait(30)
        assert peer.returncode == 0


def test_workers_map_the_arena_by_gpu_uuid_not_ordinal(cuda_pool):
    from kvpool import cuda

    with PoolClient(cuda_pool.url, name="uuid") as pool:
        desc = pool.descriptor()
        assert desc.device is not None
        assert cuda.ordinal_of(desc.device.uuid) == desc.device.index  # same visibility here
        with pytest.raises(cuda.CudaError, match="not visible"):
            cuda.ordinal_of("GPU-00000000-0000-0000-0000-000000000000")
