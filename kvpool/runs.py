"""Block ids as byte spans for a transfer engine: pairs of runs that are contiguous on both sides, then per run the
spans the arena's order lays its blocks in.

A transfer engine (NIXL) pays per descriptor it posts, not per byte: about 9 µs each measured on NIXL 1.5.1, so a
request cut into one descriptor per block and layer posts for longer than it moves. Block ``i`` of one pool goes
to block ``i`` of the other in the order the ids came (a handoff's order is the prompt's), so a run is a stretch
that is consecutive in *both* lists; each run is one descriptor per span of a block: one in ``block_major`` order
(a block is one span over all layers), ``num_layers`` in ``kv_packed``, ``2 * num_layers`` in ``layer_major``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.layout import KVLayout

#: (address, bytes) of one descriptor
Span = tuple[int, int]


@dataclass(frozen=True)
class Geometry:
    """Where an arena's blocks are in its owner's address space: what a peer needs to address them."""

    base: int
    num_blocks: int
    layout: KVLayout

    def spans(self, first: int, n: int) -> list[Span]:
        """The spans that hold blocks ``first .. first + n - 1`` (arena-local), every layer's K and V."""
        if not (first >= 0 and n >= 1 and first + n <= self.num_blocks):
            raise ValueError(f"blocks {first}..{first + n - 1} are outside an arena of {self.num_blocks} blocks")
        lay, size = self.layout, self.layout.block_layer_elems * self.layout.itemsize
        if lay.order == "block_major":
            return [(self.base + first * lay.block_nbytes, n * lay.block_nbytes)]
        if lay.order == "kv_packed":
            stride = self.num_blocks * 2 * size
            return [(self.base + layer * stride + first * 2 * size, n * 2 * size) for layer in range(lay.num_layers)]
        return [
            (self.base + part * self.num_blocks * size + first * size, n * size) for part in range(2 * lay.num_layers)
        ]


def paired_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first local, first remote, length) of each stretch where both id lists go up by one together."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
    out: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote, strict=True):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


def descriptors(
    local: Geometry, local_ids: Sequence[int], remote: Geometry, remote_ids: Sequence[int]
) -> tuple[list[Span], list[Span]]:
    """The local and remote spans, one pair per run and span of a block, for reading ``remote_ids`` into
    ``local_ids`` (arena-local ids). Both arenas must lay blocks out alike; their sizes may differ."""
    if local.layout != remote.layout:
        diff = local.layout.diff(remote.layout)
        raise ValueError(f"the arenas' layouts differ ({diff}): their blocks cannot be copied byte for byte")
    mine: list[Span] = []
    theirs: list[Span] = []
    for a, b, n in paired_runs(local_ids, remote_ids):
        mine += local.spans(a, n)
        theirs += remote.spans(b, n)
    return mine, theirs
