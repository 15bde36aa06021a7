"""Block ids as NIXL descriptors: one per run of ids contiguous on both sides and span of a block."""

from __future__ import annotations

import pytest

from kvpool.layout import KVLayout
from kvpool.runs import Geometry, descriptors, paired_runs


def test_runs_are_contiguous_on_both_sides_in_the_order_given() -> None:
    assert paired_runs([0, 1, 2, 3], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 2)]
    assert paired_runs([5, 6, 9], [1, 2, 3]) == [(5, 1, 2), (9, 3, 1)]
    assert paired_runs([3, 2], [7, 8]) == [(3, 7, 1), (2, 8, 1)]  # going down is not a run
    assert paired_runs([], []) == []
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        paired_runs([0, 1], [0])


@pytest.mark.parametrize(("order", "per_run"), [("block_major", 1), ("kv_packed", 3), ("layer_major", 6)])
def test_each_order_posts_its_spans_per_run_and_covers_every_byte(order: str, per_run: int) -> None:
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype="float32", order=order)
    local, remote = Geometry(1 << 20, 8, lay), Geometry(1 << 30, 16, lay)
    mine, theirs = descriptors(local, [0, 1, 2, 6], remote, [4, 5, 6, 9])
    assert len(mine) == len(theirs) == 2 * per_run
    assert [n for _, n in mine] == [n for _, n in theirs]
    assert sum(n for _, n in mine) == 4 * lay.block_nbytes
    covered = {a + i for a, n in mine for i in range(n)}  # the spans of distinct blocks never overlap
    assert len(covered) == 4 * lay.block_nbytes and min(covered) >= 1 << 20


def test_a_span_is_where_the_arena_lays_the_block() -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=1, dtype="float32", order="layer_major")
    # layer_major, 10 blocks of 8 bytes per K or V: K of block 3 at 24, V of block 3 at 80 + 24
    assert Geometry(1000, 10, lay).spans(3, 2) == [(1024, 16), (1104, 16)]
    with pytest.raises(ValueError, match="outside an arena of 10 blocks"):
        Geometry(1000, 10, lay).spans(9, 2)


def test_arenas_laid_out_differently_are_refused() -> None:
    a = Geometry(0, 4, KVLayout(order="layer_major"))
    b = Geometry(0, 4, KVLayout(order="block_major"))
    with pytest.raises(ValueError, match="layouts differ"):
        descriptors(a, [0], b, [0])
