"""Fenced ids and the arena indices workers hold instead: stripping and restoring generations at the boundary."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.ids import MAX_ID, Fences, arena_ids, arena_index, block_of, fence, generation_of


def test_a_fenced_id_packs_generation_above_block():
    assert fence(5, 0) == 5  # a fresh pool's ids are plain block numbers
    fenced = fence(5, 2**31 - 1)
    assert (block_of(fenced), generation_of(fenced)) == (5, 2**31 - 1) and fenced == MAX_ID - (2**32 - 1) + 5
    assert MAX_ID == 2**63 - 1  # fits a signed int64, as the wire carries it


def test_arena_ids_strip_generations_and_refuse_other_arenas():
    assert arena_ids([fence(10, 3), fence(12, 0)], first=10, num_blocks=4) == [0, 2]
    for bad in ([fence(9, 1)], [fence(14, 1)], [-1]):
        with pytest.raises(IndexError, match=r"outside this arena's ids \[10, 14\)"):
            arena_ids(bad, first=10, num_blocks=4)


@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(-2, 20)), max_size=40))
def test_arena_index_is_arena_ids_in_one_array(blocks: list[tuple[int, int]]) -> None:
    ids = [fence(b, g) if b >= 0 else b for g, b in blocks]
    try:
        want = arena_ids(ids, first=10, num_blocks=6)
    except IndexError:
        with pytest.raises(IndexError, match=r"outside this arena's ids \[10, 16\)"):
            arena_index(ids, first=10, num_blocks=6)
        return
    got = arena_index(ids, first=10, num_blocks=6)
    assert got.dtype == np.int64 and got.tolist() == want
    assert arena_index(array("q", ids), first=10, num_blocks=6).tolist() == want  # packed ids, no Python ints


def test_fences_give_back_the_generation_each_index_was_handed_out_with():
    fences = Fences(first=8, num_blocks=4)
    assert fences.strip([fence(9, 3), fence(8, 1)]) == [1, 0]
    assert fences.restore([0, 1, 1]) == [fence(8, 1), fence(9, 3), fence(9, 3)]
    assert fences.restore(array("i", [2])) == [10]  # never handed out: generation 0
    fences.strip([fence(9, 4)])  # the block came back under a newer generation
    assert fences.restore([1]) == [fence(9, 4)]
    for bad in ([4], [-1]):
        with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
            fences.restore(bad)
