"""Block allocator: reference counts, holders, a free stack and an LRU of cached blocks.

Pure Python, no torch and no HTTP, so it can be tested and reasoned about alone. Every operation costs O(1)
per block it touches. A block is in exactly one of three states, and the books always balance:

* free: ref 0, holds nothing anyone can look up; on the free stack.
* in use: ref > 0; each ref belongs to a *holder* (a session, or a parked handoff).
* cached: ref 0 but committed (its KV is findable by hash); on the LRU, evicted oldest-first when the free
  stack runs dry. Eviction never takes a block with a ref. A cached block marked *spare* (another arena holds a copy
  of its KV) is evicted before any that is not, oldest first among spares: a prefix one GPU copied from another is
  lost to the node only when its last copy goes.

A holder can hold several refs on one block (two lookups of one prefix take two refs), so each holder keeps a
count per block. Every mutating call validates its whole input first and raises before touching any state.

Block ids are global. With several arenas (one per GPU) each arena is a contiguous id range with its
own free stack and LRU: ``allocate`` takes an arena, everything else only needs the ids.

A block that ``allocate`` evicts is told to ``on_evict`` as it goes, and once it has evicted any, ``allocate`` calls
``after_evict`` before it returns: the host tier copies the evicted blocks' KV out there, so that no block reaches
its next holder (an alloc, a slab's refill, a restore) before its old KV is saved. Every taker of blocks goes through
``allocate``, so none can skip that copy.

Each block has a generation, bumped (modulo 2**31) whenever it goes back to the free stack or is evicted from the
LRU: the moments its KV stops being what an earlier holder was told. Ids leave the pool fenced with it
(:mod:`kvpool.ids`), and :meth:`unfence` refuses one whose generation is not current. Here, inside the pool, blocks
are plain numbers.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvpool.errors import InvalidRequest, NotOwner, PoolExhausted, StaleBlock
from kvpool.ids import BLOCK_BITS, BLOCK_MASK, GEN_STEP, MAX_ID, blocks_of


class BlockAllocator:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        on_evict: Callable[[int], None] | None = None,
        after_evict: Callable[[], None] | None = None,
    ) -> None:
        sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every arena needs at least 1 block, got {sizes}")
        self.sizes = sizes
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.num_blocks = sum(sizes)
        self.ref_cnt: list[int] = [0] * self.num_blocks
        self.committed: list[bool] = [False] * self.num_blocks
        self.fence_of: list[int] = list(range(self.num_blocks))  # each block's current fenced id (generation 0)
        self.arena_of: list[int] = [a for a, size in enumerate(sizes) for _ in range(size)]
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in logs and tests).
        self._free: list[list[int]] = [
            list(range(a + n - 1, a - 1, -1)) for a, n in zip(self.starts, sizes, strict=True)
        ]
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in sizes]
        self._spares: list[OrderedDict[int, None]] = [OrderedDict() for _ in sizes]  # cached blocks copied elsewhere
        self.spare: list[bool] = [False] * self.num_blocks
        self._holders: dict[str, dict[int, int]] = {}
        self._on_evict = on_evict
        self._after_evict = after_evict
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def num_cached(self) -> int:
        """Committed blocks at ref 0: reusable by lookup, evictable by alloc."""
        return sum(len(lru) for lru in self._lru) + sum(len(spares) for spares in self._spares)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def available(self, arena: int = 0) -> int:
        return len(self._free[arena]) + len(self._lru[arena]) + len(self._spares[arena])

    def counts(self, arena: int) -> tuple[int, int, int]:
        """(free, in_use, cached) of one arena."""
        free, cached = len(self._free[arena]), len(self._lru[arena]) + len(self._spares[arena])
        return free, self.sizes[arena] - free - cached, cached

    def refs_of(self, holder: str) -> Mapping[int, int]:
        """{block: refs} that ``holder`` holds, live (not a copy): read it, never keep it across a change."""
        return self._holders.get(holder, {})

    def held(self, holder: str) -> dict[int, int]:
        """{block: refs} that ``holder`` holds (a copy)."""
        return dict(self._holders.get(holder, {}))

    # -- operations -----------------------------------------------------------------------------------

    def allocate(self, holder: str, n: int, arena: int = 0) -> list[int]:
        """Take ``n`` blocks with ref 1 for ``holder``: free blocks first, then the least recently used cached.

        If it evicted any, ``after_evict`` runs before the blocks are returned; if that fails, the blocks go back to
        the free stack (their old KV is no longer findable either way) and the error propagates."""
        if n < 1:
            raise InvalidRequest(f"num_blocks must be at least 1, got {n}")
        if not 0 <= arena < len(self.sizes):
            raise InvalidRequest(f"no arena {arena}: the pool has {len(self.sizes)}")
        available = self.available(arena)
        if n > available:
            where = f" on arena {arena}" if len(self.sizes) > 1 else ""
            raise PoolExhausted(
                f"asked for {n} blocks{where} but only {available} of {self.sizes[arena]} are free or "
                "evictable (the rest are in use): free blocks, wait, or start the pool larger"
            )
        free, lru, spares = self._free[arena], self._lru[arena], self._spares[arena]
        take = min(n, len(free))
        ids = free[len(free) - take :]
        del free[len(free) - take :]
        ids.reverse()
        for _ in range(n - take):
            block, _ = (spares or lru).popitem(last=False)
            self.committed[block] = False
            self.spare[block] = False
            self._recycled(block)
            self.num_evictions += 1
            if self._on_evict is not None:
                self._on_evict(block)
            ids.append(block)
        ref = self.ref_cnt
        held = self._holders.setdefault(holder, {})
        for block in ids:
            ref[block] = 1
            held[block] = 1
        if take < n and self._after_evict is not None:
            try:
                self._after_evict()
            except BaseException:
                self.drop(holder, ids)
                raise
        return ids

    def reserve(self, holder: str, block: int) -> None:
        """Take one free block, by number, with ref 1 for ``holder`` for good (a block no one may be given, such as
        vLLM's null block): in use in the books, never on a free stack or the LRU."""
        self._check_range([block])
        free = self._free[self.arena_of[block]]
        if self.ref_cnt[block] or block not in free:
            raise InvalidRequest(f"block {block} is not free: only a free block can be reserved")
        free.remove(block)
        self.ref_cnt[block] = 1
        self._holders.setdefault(holder, {})[block] = 1

    def acquire(self, holder: str, ids: Iterable[int]) -> None:
        """Take one more ref on blocks that are in use or cached (a prefix hit)."""
        ids = list(ids)
        self._check_range(ids)
        if not ids:
            return
        for block in ids:
            if self.ref_cnt[block] == 0 and not self.committed[block]:
                raise InvalidRequest(f"block {block} is free: only cached or in-use blocks can be shared")
        held = self._holders.setdefault(holder, {})
        for block in ids:
            if self.ref_cnt[block] == 0:
                del self._cached_list(block)[block]
            self.ref_cnt[block] += 1
            held[block] = held.get(block, 0) + 1

    def free(self, holder: str, ids: Sequence[int]) -> int:
        """Drop one of ``holder``'s refs on each block; return how many blocks reached ref 0."""
        self.check_held(holder, ids)
        return self.drop(holder, ids)

    def drop(self, holder: str, blocks: Sequence[int]) -> int:
        """:meth:`free` of blocks that :meth:`unfence` with this ``holder`` returned: checked already, so the
        hot path pays one pass over the ids, not two."""
        if not blocks:
            return 0
        held = self._holders[holder]
        ref, committed, fence_of = self.ref_cnt, self.committed, self.fence_of
        freed: list[int] = []
        cached = 0
        # Reverse order puts a chain's tail at the LRU front, so tails are evicted before the prefixes they hang on.
        for block in reversed(blocks):
            left = held[block] - 1
            if left:
                held[block] = left
            else:
                del held[block]
            left = ref[block] - 1
            ref[block] = left
            if not left:
                if committed[block]:
                    self._cached_list(block)[block] = None
                    cached += 1
                else:
                    fenced = fence_of[block] + GEN_STEP  # _recycled(block), inline on this hot path
                    fence_of[block] = fenced if fenced <= MAX_ID else block
                    freed.append(block)
        if len(self._free) == 1:
            self._free[0] += freed
        else:
            stacks, arena_of = self._free, self.arena_of
            for block in freed:
                stacks[arena_of[block]].append(block)
        if not held:
            del self._holders[holder]
        return cached + len(freed)

    def _cached_list(self, block: int) -> OrderedDict[int, None]:
        return (self._spares if self.spare[block] else self._lru)[self.arena_of[block]]

    def set_spare(self, blocks: Iterable[int], spare: bool) -> None:
        """Mark blocks whose KV another arena holds a copy of (``spare``: evicted first) or no longer holds."""
        for block in blocks:
            if self.spare[block] == spare:
                continue
            cached = self.ref_cnt[block] == 0 and self.committed[block]
            if cached:  # it keeps its place in recency among the others of its kind: the youngest
                del self._cached_list(block)[block]
            self.spare[block] = spare
            if cached:
                self._cached_list(block)[block] = None

    def transfer(self, src: str, dst: str, ids: Sequence[int]) -> None:
        """Move one of ``src``'s refs on each block to ``dst``; ref counts stay as they are."""
        self.check_held(src, ids)
        if src == dst or not ids:
            return
        held = self._holders[src]
        for block in ids:
            left = held[block] - 1
            if left:
                held[block] = left
            else:
                del held[block]
        if not held:
            del self._holders[src]
        target = self._holders.get(dst)
        if target is None and len(set(ids)) == len(ids):
            self._holders[dst] = dict.fromkeys(ids, 1)  # a new holder (a handoff): its refs in one go
            return
        target = self._holders.setdefault(dst, {})
        for block in ids:
            target[block] = target.get(block, 0) + 1

    def release_holder(self, holder: str) -> int:
        """Drop every ref ``holder`` holds (a closed or crashed session); return blocks that reached ref 0."""
        held = self._holders.get(holder)
        if not held:
            self._holders.pop(holder, None)
            return 0
        ids = [block for block, count in held.items() for _ in range(count)]
        return self.free(holder, ids)

    def mark_committed(self, blocks: Sequence[int]) -> None:
        """Flag in-use blocks as holding findable KV: at ref 0 they will be cached, not freed."""
        self._check_range(blocks)
        if not blocks:
            return
        ref = self.ref_cnt
        if min(map(ref.__getitem__, blocks)) == 0:
            idle = [b for b in blocks if ref[b] == 0]
            raise InvalidRequest(f"blocks {idle[:8]} are not in use: commit blocks while holding a ref on them")
        committed = self.committed
        for block in blocks:
            committed[block] = True

    # -- fencing --------------------------------------------------------------------------------------

    @property
    def generation(self) -> list[int]:
        """Each block's generation (a copy)."""
        return [f >> BLOCK_BITS for f in self.fence_of]

    def _recycled(self, block: int) -> None:
        """Its KV is no longer what any id handed out so far says: the next generation (after 2**31 - 1, 0)."""
        fenced = self.fence_of[block] + GEN_STEP
        self.fence_of[block] = fenced if fenced <= MAX_ID else block

    def fenced(self, blocks: Sequence[int]) -> list[int]:
        """Blocks as the ids that leave the pool: each with its current generation."""
        return list(map(self.fence_of.__getitem__, blocks))

    def unfence(self, ids: Sequence[int], holder: str | None = None) -> list[int]:
        """The blocks that fenced ``ids`` name; refused (changing nothing) if one is out of range or stale, and,
        given a ``holder``, unless it holds a ref on each block for each time the block is listed (as
        :meth:`check_held`, whose range pass this one makes needless).

        It runs on every call that names blocks, so the usual case is a mask per id, a comparison of lists and a
        set's inclusion.
        """
        if type(ids) is array:  # packed, as the fast channel carries them
            blocks = blocks_of(ids)
            ids = ids.tolist()
        else:
            ids = ids if type(ids) is list else list(ids)
            blocks = [i & BLOCK_MASK for i in ids]
        try:
            current = self.fenced(blocks) == ids
        except IndexError:  # a block past the arena (a negative id lands there too)
            current = False
        if current:
            if holder is None or self._holds(holder, blocks):
                return blocks
            self.check_held(holder, blocks)
        n, fence_of = self.num_blocks, self.fence_of
        bad = [i for i in ids if not 0 <= i <= MAX_ID or i & BLOCK_MASK >= n]
        if bad:
            raise InvalidRequest(f"block ids out of range: {bad[:8]} (an id's low 32 bits are its block, in [0, {n}))")
        stale = [i for i in ids if fence_of[i & BLOCK_MASK] != i]
        raise StaleBlock(
            f"block ids {stale[:8]} are stale: their blocks were freed or evicted since the call that returned them "
            "(the high bits of an id are its block's generation), and may hold other KV now; nothing was changed. "
            "Drop these ids: look the prefix up again or allocate anew",
            tuple(stale),
        )

    # -- validation -----------------------------------------------------------------------------------

    def _check_range(self, ids: Iterable[int]) -> None:
        n = self.num_blocks
        ids = ids if isinstance(ids, list | tuple) else list(ids)
        if not ids or (min(ids) >= 0 and max(ids) < n):
            return
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise InvalidRequest(f"block ids out of range [0, {n}): {bad[:8]}")

    def check_held(self, holder: str, ids: Sequence[int]) -> None:
        """Raise unless ``holder`` holds at least as many refs on each block as ``ids`` lists it."""
        self._check_range(ids)
        if self._holds(holder, ids):
            return
        held = self._holders.get(holder, {})
        missing = [b for b, count in Counter(ids).items() if held.get(b, 0) < count]
        raise NotOwner(
            f"the session holds no reference on blocks {sorted(missing)[:8]} (never allocated by it, "
            "already freed, or listed more times than it holds them)"
        )

    def _holds(self, holder: str, blocks: Sequence[int]) -> bool:
        """Whether ``holder`` holds a ref on each of ``blocks`` (in range) for each time it is listed."""
        held = self._holders.get(holder, {})
        distinct = set(blocks)
        if len(distinct) == len(blocks):  # the usual case, without counting
            return held.keys() >= distinct
        return all(held.get(b, 0) >= count for b, count in Counter(blocks).items())

    def check(self) -> None:
        """Assert every invariant; the tests call this after each step."""
        free = {b for stack in self._free for b in stack}
        lru = {b for part in [*self._lru, *self._spares] for b in part}
        assert len(free) == self.num_free, "a block is on a free stack twice"
        assert len(lru) == self.num_cached, "a block is on two LRUs"
        for p, (stack, part, spares) in enumerate(zip(self._free, self._lru, self._spares, strict=True)):
            assert all(self.arena_of[b] == p for b in [*stack, *part, *spares]), "a block sits in another arena's lists"
            assert all(self.spare[b] for b in spares), "a block on the spares' LRU is not spare"
            assert not any(self.spare[b] for b in part), "a spare block on the LRU of the node's only copies"
        assert not free & lru, "a block is both free and cached"
        holder_refs = Counter[int]()
        for held in self._holders.values():
            assert held, "an empty holder was kept"
            for block, count in held.items():
                assert count > 0
                holder_refs[block] += count
        for block in range(self.num_blocks):
            ref = self.ref_cnt[block]
            assert ref == holder_refs.get(block, 0), f"block {block}: ref {ref} != holders' refs"
            if ref > 0:
                assert block not in free and block not in lru
            elif self.committed[block]:
                assert block in lru, f"cached block {block} missing from the LRU"
            else:
                assert block in free, f"free block {block} missing from the free stack"
        assert self.num_free + self.num_in_use + self.num_cached == self.num_blocks
        assert all(f & BLOCK_MASK == b for b, f in enumerate(self.fence_of)), "a fenced id names another block"
        assert all(0 <= f <= MAX_ID for f in self.fence_of), "a fenced id past int64"
