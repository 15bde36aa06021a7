"""What the block-copy kernel takes on and what it leaves to the gather (the kernel itself runs in tests/gpu)."""

from __future__ import annotations

import torch

from kvpool import blockcopy


def test_a_blocks_view_is_slices_of_blocks_of_whole_words() -> None:
    assert blockcopy.geometry(torch.empty(6, 10, 16, dtype=torch.bfloat16), 1) == (6, 10, 4)
    assert blockcopy.geometry(torch.empty(10, 4, 16, dtype=torch.float16), 0) == (1, 10, 16)


def test_views_the_kernel_cannot_move_are_left_to_the_gather() -> None:
    assert blockcopy.geometry(torch.empty(10, 6, 16).transpose(0, 1), 1) is None  # not contiguous
    assert blockcopy.geometry(torch.empty(6, 10, 3, dtype=torch.float16), 1) is None  # 6-byte spans
    assert blockcopy.geometry(torch.empty(2, 3, 4, 8), 2) is None
    src, dst = torch.zeros(6, 10, 16), torch.ones(6, 10, 16)
    assert not blockcopy.copy(src, [1], dst, [2], 1), "CPU tensors are the gather's"
    assert torch.all(dst == 1)
