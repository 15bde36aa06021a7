"""The arena's allocation context on a GPU (kvpool/integrations/vllm/memory.py; needs CUDA, not vLLM): the one
``torch.zeros(nbytes, int8)`` vLLM 0.29+ makes of its KV backing, made inside the context, is the pool's mapped arena;
an engine attaching keeps what the arena holds; anything else allocated inside gets its own memory; a backing that
is not the arena's size is refused when the context exits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm import memory
from kvpool.integrations.vllm.kvmemory import ArenaKV
from tests.conftest import start_pool

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def pool_flags(num_blocks: int) -> tuple[str, ...]:
    return (
        "--backend", "cuda", "--num-blocks", str(num_blocks), "--num-layers", "4", "--num-kv-heads", "2",
        "--head-dim", "64", "--block-size", "16", "--dtype", "bfloat16", "--order", "kv_packed",
    )  # fmt: skip


# 512 blocks: 16 MiB of KV, a whole number of torch's 2 MiB segments; 333: 10.4 MiB, rounded up to 12 MiB
@pytest.fixture(scope="module", params=[("vmm", 512), ("legacy", 512), ("vmm", 333), ("legacy", 333)],
                ids=["vmm-16MiB", "legacy-16MiB", "vmm-odd", "legacy-odd"])  # fmt: skip
def arena(request: Any) -> Iterator[ArenaKV]:
    handle, blocks = request.param
    pool = start_pool(*pool_flags(blocks), "--arena-handle", handle)
    client = PoolClient(pool.url, name="memory-test")
    try:
        desc = client.descriptor()
        mapped = client.arena(desc.layout)
        torch.cuda.set_device(mapped.raw.device)
        yield ArenaKV(mapped.raw.view(torch.int8), desc.layout, desc.num_blocks)
    finally:
        client.close()
        pool.stop()


def pattern(kv: ArenaKV) -> torch.Tensor:
    n = memory.kv_bytes(kv)
    return (torch.arange(n, device=kv.raw.device) % 127 + 1).to(torch.int8)


def allocate_as_vllm(kv: ArenaKV, nbytes: int | None = None) -> torch.Tensor:
    """What vLLM 0.29+'s ``allocate_kv_cache`` does for the backing (``vllm/v1/worker/utils.py``)."""
    return torch.zeros(nbytes or memory.kv_bytes(kv), dtype=torch.int8, device=kv.raw.device)


def test_an_attaching_engine_s_backing_is_the_arena_and_keeps_what_it_holds(arena: ArenaKV) -> None:
    n = memory.kv_bytes(arena)
    want = pattern(arena)
    arena.raw[:n].copy_(want)
    with memory.arena_context(arena, attaching=True):
        backing = allocate_as_vllm(arena)
        scratch = torch.ones(1000, device=arena.raw.device)  # not the backing: ordinary memory
    torch.cuda.synchronize()
    assert backing.data_ptr() == arena.raw.data_ptr()
    assert torch.equal(backing, want), "attaching zeroed (or moved) the KV other engines serve from"
    start, end = arena.raw.data_ptr(), arena.raw.data_ptr() + arena.raw.numel()
    assert not start <= scratch.data_ptr() < end and scratch.sum().item() == 1000
    backing[:16].fill_(5)  # vLLM writes KV through its views: the pool's mapping sees it
    torch.cuda.synchronize()
    assert arena.raw[:16].eq(5).all()
    del backing, scratch
    torch.cuda.empty_cache()  # the pool's free is a no-op for the arena: its bytes stay
    assert torch.equal(arena.raw[16:n], want[16:])


def test_the_first_engine_on_a_fresh_arena_zeroes_it(arena: ArenaKV) -> None:
    n = memory.kv_bytes(arena)
    arena.raw[:n].copy_(pattern(arena))
    with memory.arena_context(arena, attaching=False):
        backing = allocate_as_vllm(arena)
    torch.cuda.synchronize()
    assert backing.data_ptr() == arena.raw.data_ptr() and not arena.raw[:n].any()


def test_a_backing_that_is_not_the_arena_s_size_is_refused_and_the_arena_is_untouched(arena: ArenaKV) -> None:
    n = memory.kv_bytes(arena)
    want = pattern(arena)
    arena.raw[:n].copy_(want)
    with pytest.raises(LayoutMismatch, match="--num-gpu-blocks-override"), memory.arena_context(arena, attaching=True):
        other = allocate_as_vllm(arena, n + 8 * (1 << 20))  # an engine with more blocks than the arena
    torch.cuda.synchronize()
    assert torch.equal(arena.raw[:n], want)
    del other
