"""Arena views and backends without a server: geometry, aliasing, sizing, the CPU backend's file."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from kvpool.arena import FetchedFd, open_arena
from kvpool.errors import InvalidRequest, LayoutMismatch
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor
from kvpool.server.arenas import CpuOwnedArena, size_in_blocks


@pytest.fixture
def cpu_arena(tmp_path):
    def make(layout: KVLayout, num_blocks: int = 6):
        host = CpuOwnedArena(num_blocks * layout.block_nbytes, tmp_path, epoch=os.urandom(4).hex())
        descriptor = ArenaDescriptor(
            epoch="e-" + host.path.name, backend="cpu", device=None, handle=host.handle, handle_kind="shm",
            nbytes=host.nbytes, num_blocks=num_blocks, block_nbytes=layout.block_nbytes, layout=layout,
            owner_pid=os.getpid(),
        )  # fmt: skip
        return host, open_arena(descriptor)

    return make


@pytest.mark.parametrize("order", ["layer_major", "block_major", "kv_packed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_views_tile_the_arena_exactly_once(cpu_arena, order, dtype):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=dtype, order=order)
    _, arena = cpu_arena(layout)
    seen = torch.zeros(arena.raw.numel() // layout.itemsize, dtype=torch.int32)
    flat = torch.arange(seen.numel(), dtype=torch.int64)
    for layer in range(3):
        for view in (arena.k(layer), arena.v(layer)):
            assert view.shape == (6, 2, 2, 4) and view.dtype == getattr(torch, dtype)
            idx = flat.as_strided(view.shape, view.stride(), view.storage_offset())
            seen[idx.reshape(-1)] += 1
    assert torch.all(seen == 1), "every element belongs to exactly one (layer, K/V, block, slot) view"


def test_block_major_keeps_a_block_contiguous(cpu_arena):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=2, dtype="float32", order="block_major")
    _, arena = cpu_arena(layout)
    arena.v(1)[4].fill_(1.0)
    nz = arena.raw.view(torch.float32).nonzero().flatten()
    per_block = layout.block_nbytes // 4
    assert nz.min() >= 4 * per_block and nz.max() < 5 * per_block


def test_kv_packed_is_vllm_s_layer_cache_and_its_block_copies_round_trip(cpu_arena):
    """A kv_packed layer region, viewed as vLLM 0.26's TRITON_ATTN / FLASH_ATTN (NHD) cache of shape [blocks,
    block_size, heads, 2 * head_dim], holds K at [..., :head_dim] and V at [..., head_dim:] of the same views that
    k() and v() give; and the block view copies whole blocks."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype="float32", order="kv_packed")
    _, arena = cpu_arena(layout)
    for layer in range(3):
        offset, size = layout.layer_region(6, layer)
        vllm_cache = arena.raw[offset : offset + size].view(torch.float32).view(6, 2, 2, 8)
        vllm_cache.copy_(torch.randn_like(vllm_cache))
        assert torch.equal(arena.k(layer), vllm_cache[..., :4]) and torch.equal(arena.v(layer), vllm_cache[..., 4:])
    blocks, dim = arena.blocks_view()
    before = [t.clone() for t in arena.block(2)]
    blocks.index_copy_(dim, torch.tensor([4]), blocks.index_select(dim, torch.tensor([2])))
    assert all(torch.equal(a, b) for a, b in zip(arena.block(4), before, strict=True))


def test_only_kv_packed_keeps_a_layer_in_a_span_of_its_own_and_block_0():
    packed = KVLayout(order="kv_packed")
    assert packed.reserved_blocks == 1 and packed.layer_region(10, 1) == (
        10 * packed.block_nbytes // 4,
        10 * packed.block_nbytes // 4,
    )
    for order in ("layer_major", "block_major"):
        layout = KVLayout(order=order)
        assert layout.reserved_blocks == 0
        with pytest.raises(LayoutMismatch, match="kv_packed"):
            layout.layer_region(10, 0)


def test_cpu_arena_file_is_owner_only_and_removed_on_close(cpu_arena):
    host, arena = cpu_arena(KVLayout(num_layers=1, block_size=2))
    mode = stat.S_IMODE(os.stat(host.path).st_mode)
    assert mode == 0o600
    assert arena.raw.numel() == host.nbytes
    host.close()
    assert not host.path.exists()


def test_open_arena_refuses_another_layout_and_maps_once(cpu_arena):
    layout = KVLayout(num_layers=1, block_size=2)
    _, arena = cpu_arena(layout)
    desc = arena.descriptor
    assert open_arena(desc) is arena
    with pytest.raises(LayoutMismatch, match="block_size: pool 2 != yours 16"):
        open_arena(desc, KVLayout(num_layers=1))


def test_sizing_by_blocks_bytes_or_gpu_share():
    layout = KVLayout()  # 64 KiB blocks
    assert size_in_blocks(layout, num_blocks=7, arena_bytes=None, gpu_memory_fraction=None, free_device_bytes=None) == 7
    assert size_in_blocks(layout, num_blocks=None, arena_bytes=1 << 20, gpu_memory_fraction=None,
                          free_device_bytes=None) == 16  # fmt: skip
    assert size_in_blocks(layout, num_blocks=None, arena_bytes=None, gpu_memory_fraction=0.5,
                          free_device_bytes=4 << 20) == 32  # fmt: skip
    with pytest.raises(InvalidRequest, match="cuda backend"):
        size_in_blocks(layout, num_blocks=None, arena_bytes=None, gpu_memory_fraction=0.5, free_device_bytes=None)
    with pytest.raises(InvalidRequest, match="at least one block"):
        size_in_blocks(layout, num_blocks=None, arena_bytes=100, gpu_memory_fraction=None, free_device_bytes=None)


def test_block_table_takes_lists_and_packed_ids_and_never_aliases_them(cpu_arena):
    from array import array

    import numpy as np

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2)
    _, arena = cpu_arena(layout, num_blocks=6)
    packed = array("i", [5, 0, 3])
    for ids in ([5, 0, 3], packed, np.array([5, 0, 3], dtype=np.int32)):
        table = arena.block_table(ids)
        assert table.dtype == torch.int32 and table.tolist() == [5, 0, 3]
    table = arena.block_table(packed)
    packed[0] = 1
    assert table.tolist() == [5, 0, 3]  # a copy: the caller may reuse its buffer at once
    assert arena.block_table([]).numel() == 0
    for bad in ([6], [-1], array("i", [0, 9])):
        with pytest.raises(IndexError, match=r"outside this arena's ids \[0, 6\)"):
            arena.block_table(bad)
    fenced = array("q", [7 << 32 | 5, 0, (2**31 - 1) << 32 | 3])  # ids as the pool hands them out: generations on top
    for ids in (fenced, np.array(fenced, dtype=np.int64), torch.tensor(fenced.tolist())):
        assert arena.block_table(ids).tolist() == [5, 0, 3]
    assert arena.local_ids(fenced) == [5, 0, 3]


def test_an_fd_fetched_with_the_descriptor_maps_its_device_once_and_is_closed_if_unused():
    fetched: list[int | None] = []
    read, write = os.pipe()
    os.close(write)
    source = FetchedFd(read, None, lambda d: fetched.append(d) or -1)
    assert source(None) == read and source(None) == -1 and source(2) == -1 and fetched == [None, 2]
    source.close()
    os.fstat(read)  # handed over: the mapping owns it, not the source
    os.close(read)
    spare, write = os.pipe()
    os.close(write)
    FetchedFd(spare, 0, lambda d: -1).close()
    with pytest.raises(OSError):
        os.fstat(spare)
