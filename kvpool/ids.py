"""Block ids: fenced with their block's generation, packed for the wire, and numbered per arena.

Fenced: every id the pool hands out is ``generation << 32 | block``. The pool bumps a block's generation each time
the block goes back to its free list or is evicted from the prefix cache, and refuses an id whose generation is
not the block's current one (:class:`kvpool.errors.StaleBlock`): an id that outlived its grant (a delayed or
replayed message, a worker paused past its TTL) names nothing any more instead of whatever block now sits there.
The generation keeps 31 bits and wraps, so an id is a non-negative int64; a fresh pool's ids (generation 0) are
plain block numbers. A stale id passes again only if its block went through exactly a multiple of 2**31 frees and
evictions while it was held elsewhere: at a million reuses a second of that one block, over half an hour.

Packed: int64, little-endian, as the fast channel and the inbox carry them. A memcpy where JSON costs a parse per
id (about 55 ns an id with pydantic), so a request's thousands of ids stay cheap on the hot path.

Numbered: the pool numbers blocks across all its arenas (one per GPU, each a contiguous range starting at its
``first_block``); a kernel indexes one arena's views from 0, with no generation. The conversion happens at the
pool boundary (:class:`kvpool.arena.Arena`, :class:`kvpool.devices.DeviceSession`, :class:`Fences`) and nowhere
in worker code.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.errors import InvalidRequest

BLOCK_BITS = 32
BLOCK_MASK = (1 << BLOCK_BITS) - 1
GEN_BITS = 31
GEN_MASK = (1 << GEN_BITS) - 1
MAX_ID = (1 << (BLOCK_BITS + GEN_BITS)) - 1
GEN_STEP = 1 << BLOCK_BITS  # what one more generation adds to an id
ITEM = 8  # bytes of one packed id
_INT64 = frozenset({"q", "<q", "=q", "l", "<l", "=l"} if array("l").itemsize == 8 else {"q", "<q", "=q"})
_INT32 = frozenset({"i", "<i", "=i"})


def fence(block: int, generation: int) -> int:
    return generation << BLOCK_BITS | block


def block_of(block_id: int) -> int:
    """The block number a fenced id names (its low 32 bits)."""
    return block_id & BLOCK_MASK


def generation_of(block_id: int) -> int:
    return block_id >> BLOCK_BITS


def pack_ids(ids: Sequence[int] | Any) -> memoryview | None:
    """Block ids as int64 bytes: without a copy when they already are (``array('q')``, a 1-D int64 numpy array
    or CPU tensor), else packed from the sequence (int32 arrays too); None when a value does not fit in int64
    (the caller then sends JSON, and the pool says what is wrong with it)."""
    if type(ids) is array and ids.typecode == "q" and sys.byteorder == "little":  # the hot path: no checks to pay
        return memoryview(ids).cast("B")
    if sys.byteorder == "little" and type(ids) is not list:
        if type(ids).__module__.startswith("torch") and ids.device.type == "cpu":
            ids = ids.numpy()  # shares the tensor's memory
        try:
            view = memoryview(ids)
        except TypeError:
            view = None
        if view is not None and view.ndim == 1 and view.c_contiguous:
            if view.format in _INT64:
                return view.cast("B")
            if view.format in _INT32:
                return memoryview(array("q", view)).cast("B")
    if not isinstance(ids, list | tuple):
        ids = list(ids)
    packed = bytearray(ITEM * len(ids))  # writable, as the arrays above are (torch.frombuffer takes either)
    try:  # struct reads a fenced id (two 30-bit digits) in about half the time array('q', ...) takes
        struct.pack_into(f"<{len(ids)}q", packed, 0, *ids)
    except (struct.error, TypeError):
        return None
    return memoryview(packed)


def unpack_ids(data: bytes | memoryview) -> array:
    if len(data) % ITEM:
        raise InvalidRequest(
            f"attached block ids must be whole int64 values: {len(data)} bytes is not a multiple of {ITEM}"
        )
    ids = array("q")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def blocks_of(ids: array) -> list[int]:
    """The block numbers of packed ids (``array('q')``): the low halves of the int64s, read as one strided view
    where the host is little-endian, instead of a mask per id."""
    if ids.typecode == "q" and sys.byteorder == "little":
        return memoryview(ids).cast("B").cast("I")[::2].tolist()
    return [i & BLOCK_MASK for i in ids]


def arena_ids(block_ids: Sequence[int], first: int, num_blocks: int) -> list[int]:
    """Pool block ids (fenced or not) as indices into the arena whose ids start at ``first``; refused if any lies
    outside it."""
    local = [(b & BLOCK_MASK) - first for b in block_ids]
    if local and (min(local) < 0 or max(local) >= num_blocks or min(block_ids) < 0):
        raise IndexError(f"blocks outside this arena's ids [{first}, {first + num_blocks}): {list(block_ids)[:8]}")
    return local


def arena_index(block_ids: Sequence[int] | Any, first: int, num_blocks: int) -> np.ndarray:
    """:func:`arena_ids` as one int64 array, in one vectorized pass: a copy of hundreds of blocks pays a few
    microseconds here where a Python int per id costs tens."""
    packed = pack_ids(block_ids)
    if packed is None:
        raise IndexError(f"block ids outside int64: {list(block_ids)[:8]}")
    given = np.frombuffer(packed, dtype="<i8")
    local = (given & BLOCK_MASK) - first
    if len(local) and (given.min() < 0 or local.min() < 0 or local.max() >= num_blocks):
        raise IndexError(f"blocks outside this arena's ids [{first}, {first + num_blocks}): {given.tolist()[:8]}")
    return local


class Fences:
    """The fenced id last handed to this process for each block of one arena, so that worker code can hold plain
    arena indices and the pool still gets fenced ids back.

    An id comes back with the generation this process was last given for that block: while it holds a ref the
    generation cannot change, and once it let go, the pool refuses the old generation. (Naming an index after it
    took the same block again names the new grant: arena indices cannot tell the two apart.)
    """

    def __init__(self, first: int, num_blocks: int) -> None:
        self.first = first
        self.num_blocks = num_blocks
        self.table = array("q", range(first, first + num_blocks))

    def strip(self, block_ids: Sequence[int]) -> list[int]:
        """Fenced pool ids as arena indices, remembering each one's generation."""
        local = arena_ids(block_ids, self.first, self.num_blocks)
        table = self.table
        for i, b in zip(local, block_ids, strict=True):
            table[i] = b
        return local

    def restore(self, local_ids: Sequence[int]) -> list[int]:
        """Arena indices as the fenced pool ids they were handed out as."""
        table, n = self.table, self.num_blocks
        try:
            out = [table[i] for i in local_ids]
        except (IndexError, TypeError):
            out = []
        if len(out) != len(local_ids) or (local_ids and min(local_ids) < 0):
            bad = [i for i in local_ids if not (isinstance(i, int) and 0 <= i < n)]
            raise IndexError(f"arena indices outside [0, {n}): {bad[:8]}")
        return out
