"""The block-copy kernel on GPUs: every byte of each block lands in its target and nothing else moves, between two
GPUs and within one; and the pool's peer copies (a lookup on GPU 1 of a prompt committed on GPU 0) through it."""

from __future__ import annotations

import pytest
import torch

from kvpool import blockcopy
from kvpool.client import PoolClient
from tests.conftest import start_pool
from tests.gpu.blocks import fill, read

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(blockcopy._kernel() is None, reason="needs Triton"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def views(dim: int, src_dev: str, dst_dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (lambda n: (n, 4, 1000)) if dim == 0 else (lambda n: (6, n, 1000))
    src = torch.randn(shape(300), device=src_dev).to(torch.bfloat16)
    dst = torch.full(shape(200), 7.0, device=dst_dev, dtype=torch.bfloat16)
    return src, dst


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("where", ["two-gpus", "one-gpu"])
def test_each_block_lands_whole_in_its_target_and_nothing_else_moves(dim: int, where: str) -> None:
    if where == "two-gpus" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    src, dst = views(dim, "cuda:0", "cuda:1" if where == "two-gpus" else "cuda:0")
    g = torch.Generator().manual_seed(dim)
    for n in (64, 17):  # the second copy goes through the kernel as built by the first, launched directly
        dst.fill_(7.0)
        src_ids = torch.randperm(300, generator=g)[:n].tolist()
        dst_ids = torch.randperm(200, generator=g)[:n].tolist()
        assert blockcopy.copy(src, src_ids, dst, dst_ids, dim), "the kernel ran"
        torch.cuda.synchronize(dst.device)
        want = src.index_select(dim, torch.tensor(src_ids, device=src.device)).cpu()
        assert torch.equal(dst.index_select(dim, torch.tensor(dst_ids, device=dst.device)).cpu(), want)
        untouched = sorted(set(range(200)) - set(dst_ids))
        assert torch.all(dst.index_select(dim, torch.tensor(untouched, device=dst.device)) == 7.0)
    assert blockcopy._route(src, dst, dim).built, "the second copy launched the built kernel"


@two_gpus
@pytest.mark.parametrize("handle", ["vmm", "legacy"])
def test_a_prefix_committed_on_one_gpu_is_copied_whole_into_the_other_s_arena_by_the_pool(handle: str) -> None:
    bs = 16
    pool = start_pool(
        "--backend", "cuda", "--devices", "0,1", "--num-blocks", "256", "--num-layers", "4", "--num-kv-heads", "8",
        "--head-dim", "64", "--block-size", str(bs), "--dtype", "bfloat16", "--order", "kv_packed",
        "--arena-handle", handle,
    )  # fmt: skip
    try:
        with PoolClient(pool.url, name="peers") as c:
            a0, a1 = c.arena(device=0), c.arena(device=1)
            tokens = list(range(1000, 1000 + 12 * bs))
            blocks = c.alloc(12, device=0)
            payload = fill(a0, blocks)
            c.commit(blocks, tokens, release=True)
            hit = c.lookup(tokens, device=1)
            assert hit.num_tokens == 12 * bs
            assert torch.equal(read(a1, hit.block_ids), payload)
            assert c.stats()["counters"]["peer_copied_blocks"] == 12
    finally:
        pool.stop()
