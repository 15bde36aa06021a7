"""Block ids in the two forms they travel in, and the two numberings they come in.

Packed: int32, little-endian, as the fast channel and the inbox carry them and as a block table wants them. A
memcpy where JSON costs a parse per id (about 55 ns an id with pydantic), so a request's thousands of ids stay
cheap on the hot path.

Numbered: the pool numbers blocks across all its arenas (one per GPU, each a contiguous range starting at its
``first_block``); a kernel indexes one arena's views from 0. The conversion happens at the pool boundary
(:class:`kvpool.arena.Arena`, :class:`kvpool.devices.DeviceSession`) and nowhere in worker code.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

from kvpool.errors import InvalidRequest


def pack_ids(ids: Sequence[int] | Any) -> memoryview | None:
    """Block ids as int32 bytes: without a copy when they already are (``array('i')``, a 1-D int32 numpy array
    or CPU tensor), else packed from the sequence; None when a value does not fit in int32 (the caller then
    sends JSON, and the pool says what is wrong with it)."""
    if type(ids) is array and ids.typecode == "i" and sys.byteorder == "little":  # the hot path: no checks to pay
        return memoryview(ids).cast("B")
    if sys.byteorder == "little":
        if type(ids).__module__.startswith("torch") and ids.device.type == "cpu":
            ids = ids.numpy()  # shares the tensor's memory
        try:
            view = memoryview(ids)
        except TypeError:
            view = None
        if view is not None and view.format in ("i", "<i", "=i") and view.ndim == 1 and view.c_contiguous:
            return view.cast("B")
    try:
        packed = array("i", ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return memoryview(packed).cast("B")


def unpack_ids(data: bytes | memoryview) -> array:
    if len(data) % 4:
        raise InvalidRequest(f"attached block ids must be whole int32 values: {len(data)} bytes is not a multiple of 4")
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def arena_ids(block_ids: Sequence[int], first: int, num_blocks: int) -> list[int]:
    """Pool block ids as indices into the arena whose ids start at ``first``; refused if any lies outside it."""
    local = list(block_ids) if not first else [b - first for b in block_ids]
    if local and (min(local) < 0 or max(local) >= num_blocks):
        raise IndexError(f"blocks outside this arena's ids [{first}, {first + num_blocks}): {list(block_ids)[:8]}")
    return local


def pool_ids(arena_ids: Sequence[int], first: int) -> Sequence[int]:
    """An arena's block indices as the pool numbers them."""
    return [b + first for b in arena_ids] if first else arena_ids
