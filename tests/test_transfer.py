"""Blocks copied between two arenas by ids, on the CPU: every layer's K and V of each block, and nothing else."""

from __future__ import annotations

import pytest
import torch

from kvpool.arena import Arena
from kvpool.errors import InvalidRequest
from kvpool.ids import fence
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor
from kvpool.transfer import copy_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
N = 8


def arena(first_block: int, layout: KVLayout = LAYOUT) -> Arena:
    raw = torch.zeros(N * layout.block_nbytes, dtype=torch.uint8)
    desc = ArenaDescriptor(epoch="t", backend="cpu", device=None, handle="", handle_kind="shm", nbytes=raw.numel(),
                           num_blocks=N,
                           block_nbytes=layout.block_nbytes, layout=layout, owner_pid=0,
                           first_block=first_block)  # fmt: skip
    return Arena(desc, raw)


def fill(a: Arena) -> None:
    """Each element of the arena a number of its own, so that any byte copied to a wrong place shows."""
    a.raw.view(torch.float32).copy_(torch.arange(a.raw.numel() // 4, dtype=torch.float32))


def test_the_listed_blocks_every_layer_s_k_and_v_land_in_the_target_blocks_in_order():
    src, dst = arena(0), arena(N)  # the second arena's ids start where the first's end, as a pool numbers them
    fill(src)
    assert copy_blocks(src, [5, 1, 2], dst, [N + 0, N + 7, N + 3]) is None  # done on return, on the CPU
    for layer in range(LAYOUT.num_layers):
        for s, d in ((5, 0), (1, 7), (2, 3)):
            assert torch.equal(dst.k(layer)[d], src.k(layer)[s]) and torch.equal(dst.v(layer)[d], src.v(layer)[s])
        for b in set(range(N)) - {0, 7, 3}:
            assert not dst.k(layer)[b].any() and not dst.v(layer)[b].any()


def test_fenced_ids_copy_the_blocks_they_name():
    src, dst = arena(0), arena(0)
    fill(src)
    copy_blocks(src, [fence(3, 5)], dst, [fence(6, 1)])  # generations are the pool's business, not the copy's
    assert torch.equal(dst.k(1)[6], src.k(1)[3]) and torch.equal(dst.v(0)[6], src.v(0)[3])


def test_nothing_to_copy_is_no_copy():
    src, dst = arena(0), arena(0)
    fill(src)
    assert copy_blocks(src, [], dst, []) is None and not dst.raw.any()


def test_a_copy_that_cannot_be_right_is_refused_before_any_byte_moves():
    src, dst = arena(0), arena(0)
    fill(src)
    with pytest.raises(InvalidRequest, match="give one target per block"):
        copy_blocks(src, [1, 2], dst, [3])
    other = arena(0, LAYOUT.model_copy(update={"head_dim": 4}))
    with pytest.raises(InvalidRequest, match="arenas of different layouts"):
        copy_blocks(src, [1], other, [1])
    with pytest.raises(IndexError, match="outside this arena"):  # an id of no block of the source arena
        copy_blocks(src, [N + 1], dst, [1])
    assert not dst.raw.any() and not other.raw.any()
