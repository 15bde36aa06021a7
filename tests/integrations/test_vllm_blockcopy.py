"""The one-launch block copy lands the same bytes as the torch loop, for every cache shape ``kv_views`` reads."""

from __future__ import annotations

import pytest
import torch

from kvpool.integrations.vllm import blockcopy
from kvpool.integrations.vllm.kvviews import BlockCopier, kv_views
from kvpool.layout import KVLayout

LAYERS, BLOCKS, ARENA_BLOCKS = 3, 12, 20


def engine_cache(kind: str, layout: KVLayout, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    h, bs, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    shape = {"packed": (BLOCKS, h, bs, 2 * d), "heads": (BLOCKS, 2 * h, bs, d),
             "kv_first": (2, BLOCKS, bs, h, d), "kv_second": (BLOCKS, 2, bs, h, d)}[kind]  # fmt: skip
    return torch.randn(shape, device=dev).to(dtype)


def copiers(kind: str, layout: KVLayout, dtype: torch.dtype, dev: torch.device) -> tuple[BlockCopier, BlockCopier]:
    """The same random engine and arena twice: one copier on the kernel, one on the torch loop."""
    h, bs, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    caches = [engine_cache(kind, layout, dtype, dev) for _ in range(LAYERS)]
    arena = [torch.randn(2, ARENA_BLOCKS, bs, h, d, device=dev).to(dtype) for _ in range(LAYERS)]
    out = []
    for kernel in (True, False):
        eng = [kv_views(c.clone(), layout) for c in caches]
        ar = [(a[0], a[1]) for a in (x.clone() for x in arena)]
        out.append(BlockCopier(eng, ar, kernel=kernel))
    return out[0], out[1]


def same(a: BlockCopier, b: BlockCopier) -> None:
    for side_a, side_b in ((a.engine, b.engine), (a.arena, b.arena)):
        for (ka, va), (kb, vb) in zip(side_a, side_b, strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def check(kind: str, head_dim: int, dtype: torch.dtype, dev: torch.device) -> None:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=head_dim, block_size=4,
                      dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    fast, slow = copiers(kind, layout, dtype, dev)
    assert fast.sides is not None and slow.sides is None
    gen = torch.Generator().manual_seed(7)
    src = torch.randperm(ARENA_BLOCKS, generator=gen)[:5].tolist()
    dst = torch.randperm(BLOCKS, generator=gen)[:5].tolist()
    for c in (fast, slow):
        c.load(src, dst)
    same(fast, slow)
    assert torch.equal(fast.engine[2][1][dst[4]], fast.arena[2][1][src[4]])
    for c in (fast, slow):
        c.save(dst[::-1], src)
    same(fast, slow)
    for c in (fast, slow):
        c.load_layer(1, c.pairs(src[:3], dst[2:]))
    same(fast, slow)
    for c in (fast, slow):
        c.load([], [])
    same(fast, slow)


KINDS = ["packed", "heads", "kv_first", "kv_second"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.skipif(not blockcopy.usable(torch.device("cpu")), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_torch_loop_interpreted(kind: str, dtype: torch.dtype) -> None:
    check(kind, 8, dtype, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or blockcopy.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_kernel_equals_torch_loop_on_gpu(kind: str, dtype: torch.dtype, head_dim: int) -> None:
    check(kind, head_dim, dtype, torch.device("cuda"))
    torch.cuda.synchronize()


def test_views_with_differing_strides_fall_back_to_the_torch_loop() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    caches = [torch.randn(BLOCKS, 2, 4, 16), torch.randn(BLOCKS, 4, 4, 8)]
    eng = [kv_views(c, layout) for c in caches]
    arena = [torch.randn(2, ARENA_BLOCKS, 4, 2, 8) for _ in range(2)]
    c = BlockCopier(eng, [(a[0], a[1]) for a in arena], kernel=True)
    assert c.sides is None
    c.load([3, 4], [0, 9])
    for (k, v), a in zip(eng, arena, strict=True):
        assert torch.equal(k[9], a[0][4]) and torch.equal(v[0], a[1][3])


def test_unequal_block_lists_are_refused() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    c = BlockCopier([kv_views(torch.zeros(BLOCKS, 2, 4, 16), layout)], [(torch.zeros(4, 4, 2, 8),) * 2])
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        c.load([1, 2], [3])
