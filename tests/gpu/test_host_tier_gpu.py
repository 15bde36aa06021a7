"""The host tier on a real GPU: what ``kvpool serve --host-blocks`` builds, copying over PCIe on a side stream."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from kvpool.server.arenas import create_owned_arena, describe
from kvpool.server.tiers.tiermemory import HostTierMemory
from tests.conftest import start_pool

pytestmark = pytest.mark.gpu


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on /dev/shm: page-locking a mapping needs a tmpfs (a disk-backed /tmp may refuse it)."""
    path = Path(tempfile.mkdtemp(prefix="kvp-tier-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_blocks_cross_to_page_locked_host_memory_and_back_unchanged(order: str, shm_dir: Path) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16", order=order)
    epoch, n = secrets.token_hex(8), 64
    arena = create_owned_arena("cuda", n * layout.block_nbytes, device=0, shm_dir=shm_dir, epoch=epoch)
    memory = HostTierMemory(n, layout, shm_dir, epoch, describe(epoch, [0], [arena], [n], layout, "", None), [arena])
    try:
        assert memory.registered, "the host tier must be page-locked on CUDA"
        copier = memory.tier.copier
        view, dim = copier.arenas[0]
        assert view.is_cuda
        src = [5, 60, 1, 33, 2]
        idx = torch.tensor(src, device=view.device)
        payload = torch.randn(view.index_select(dim, idx).shape, device=view.device).to(view.dtype)
        view.index_copy_(dim, idx, payload)
        copier.offload(0, src, [40, 10, 11, 12, 3])  # host runs: [3], [10, 11, 12], [40]
        view.index_copy_(dim, idx, torch.zeros_like(payload))
        dst = [63, 0, 7, 8, 20]
        copier.restore(0, [40, 10, 11, 12, 3], dst)
        got = view.index_select(dim, torch.tensor(dst, device=view.device))
        assert torch.equal(got, payload)
        assert copier.totals.restored_bytes == 5 * layout.block_nbytes
    finally:
        memory.close()
        arena.close()


def test_a_cuda_pool_restores_a_prefix_from_its_host_tier() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    pool = start_pool("--backend", "cuda", "--num-blocks", "16", "--host-blocks", "64", "--num-layers", "4",
                      "--num-kv-heads", "2", "--head-dim", "64", "--block-size", "16",
                      "--dtype", "bfloat16")  # fmt: skip
    try:
        with PoolClient(pool.url, name="gpu-tier", role="prefill", layout=layout) as client:
            arena = client.arena()
            tokens = list(range(1000, 1000 + 8 * 16))
            ids = client.alloc(8)
            for i, b in enumerate(ids):
                for t in arena.block(b):
                    t.fill_(i + 1)
            torch.cuda.synchronize()
            client.commit(ids, tokens)
            client.free(ids)
            client.free(client.alloc(16))  # the whole arena: the prefix goes to the host tier
            hit = client.lookup(tokens)
            assert hit.num_tokens == len(tokens)
            assert [float(arena.block(b)[0].flatten()[0]) for b in hit.block_ids] == [i + 1 for i in range(8)]
            client.free(hit.block_ids)
        tiers = pool.stats()["tiers"]
    finally:
        pool.stop()
    assert tiers["host"]["hit_blocks"] == 8 and tiers["host"]["restore_bytes_per_s"] > 0
    for t in tiers.values():
        assert t["free"] + t["in_use"] + t["cached"] == t["num_blocks"] and t["in_use"] == 0
