"""Prefixes across the GPUs of one node: a lookup on one arena that another arena can serve further gets those
blocks copied over, in one batched copy, and indexed in its own arena.

A pool with an arena per GPU (``--devices 0,1``) keeps a prefix chain per arena: the KV of a block is where an
engine on that GPU can read it. Without this, a system prompt computed on GPU 0 is computed again on GPU 3. Here,
when a lookup in arena ``j`` stops short and another arena holds the prompt further, the pool allocates the missing
blocks in ``j`` for the caller (refs taken, as for any hit), copies the KV from the other arena (the pool maps every
arena it owns; on GPUs one peer copy over NVLink), indexes the copies in ``j``'s chain after the local prefix, and
records which blocks are copies of which. The node then holds at most one copy of a prefix per GPU that used it,
and each arena evicts its copies on its own; a block whose KV another arena also holds is *spare* and is evicted
before blocks that are the node's only copy (:meth:`kvpool.server.books.allocator.BlockAllocator.set_spare`), so a
prefix
is lost only when its last copy goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvpool.errors import PoolExhausted
from kvpool.layout import KVLayout
from kvpool.server.books.allocator import BlockAllocator
from kvpool.server.books.prefix import PrefixHasher, PrefixIndex

log = logging.getLogger(__name__)

#: the holder of a copy's source blocks while the copy runs
COPYING = "c:copying"

#: copy blocks of one arena into blocks of another: (source arena, its local ids, destination arena, its local ids)
PeerCopy = Callable[[int, np.ndarray, int, np.ndarray], None]


class Books(Protocol):
    """What of the pool's books a peer copy reads and writes (:class:`kvpool.server.books.pool.Pool`)."""

    layout: KVLayout
    hashers: list[PrefixHasher]
    index: PrefixIndex
    allocator: BlockAllocator
    host_tier: Any
    counters: Any
    prefix: Any  # its PrefixCache, which records what a copy brought over


@dataclass
class Pending:
    """A copy :meth:`PeerCopies.extend` decided, made at :meth:`PeerCopies.finish`."""

    source: int
    src: list[int]
    arena: int
    dst: list[int]


class PeerCopies:
    def __init__(self, pool: Books, copy: PeerCopy) -> None:
        self.pool = pool
        self.copy = copy
        #: block -> the blocks, in any arena, that hold the same KV (one set shared by all of them)
        self.copies: dict[int, set[int]] = {}
        self._pending: list[Pending] = []

    def finish(self) -> set[int]:
        """Make the copies :meth:`extend` decided since the last call, one per pair of arenas. Returns the blocks
        whose copy failed: already out of the index and no copy of anything, with the refs the caller's lookups
        took on them still held (the caller drops them)."""
        pending, self._pending = self._pending, []
        groups: dict[tuple[int, int], list[Pending]] = {}
        for p in pending:
            groups.setdefault((p.source, p.arena), []).append(p)
        failed: set[int] = set()
        allocator, c = self.pool.allocator, self.pool.counters
        for (source, arena), batch in groups.items():
            src = [b for p in batch for b in p.src]
            dst = [b for p in batch for b in p.dst]
            try:
                self.copy(source, self._local(src, source), arena, self._local(dst, arena))
            except Exception:
                log.exception("copying %d prefix blocks from arena %d to arena %d failed", len(src), source, arena)
                for block in dst:
                    self.evicted(block)
                    self.pool.index.remove_block(block)
                    allocator.committed[block] = False
                failed.update(dst)
                c.peer_copies -= len(batch)
                c.peer_copied_blocks -= len(dst)
            finally:
                allocator.drop(COPYING, src)
        return failed

    def extend(
        self, holder: str, token_ids: Sequence[int], salt: str | None, arena: int, local: list[int]
    ) -> list[int]:
        """Blocks past ``local`` (the prompt's prefix ``arena`` holds) to be copied from the arena that holds the
        prompt furthest, indexed in ``arena``, with a ref each for ``holder``; none if no arena holds more or
        ``arena`` has no room. They hold no KV until :meth:`finish` made the copy: the caller answers nobody before
        (nothing else runs on the pool's loop meanwhile, and the sources are held), so that a burst's copies go in
        one."""
        pool, bs = self.pool, self.pool.layout.block_size
        k, full = len(local), len(token_ids) // bs
        best: list[int] = []
        source = -1
        on_host = pool.host_tier.host_of if pool.host_tier is not None else {}
        for other, hasher in enumerate(pool.hashers):
            if other == arena:
                continue
            found = []
            for node in pool.index.match_nodes(hasher.blocks(token_ids[: full * bs], salt)):
                if node in on_host:  # its KV is in host memory now, not in that arena: the copy stops before it
                    break
                found.append(node.block)
            if len(found) > len(best):
                best, source = found, other
        if len(best) <= k:
            return []
        src = best[k:]
        allocator = pool.allocator
        try:
            dst = allocator.allocate(holder, len(src), arena)
        except PoolExhausted:
            return []
        allocator.acquire(COPYING, src)  # cached sources stay put until they are read
        self._pending.append(Pending(source, src, arena, dst))
        pool.prefix.record(dst, token_ids[: (k + len(dst)) * bs], salt, k, k + len(dst), count=False)
        for s, d in zip(src, dst, strict=True):
            self._link(s, d)
        c = pool.counters
        c.peer_copies += 1
        c.peer_copied_blocks += len(dst)
        return dst

    def _local(self, blocks: list[int], arena: int) -> np.ndarray:
        return np.asarray(blocks, dtype=np.int64) - self.pool.allocator.starts[arena]

    def _link(self, a: int, b: int) -> None:
        group = self.copies.get(a)
        if group is None:
            group = self.copies[a] = {a}
        group.add(b)
        self.copies[b] = group
        self.pool.allocator.set_spare(group, True)

    def evicted(self, block: int) -> None:
        """``block`` no longer holds the KV it shared with others: the last other copy, if one is left alone, is no
        longer spare."""
        group = self.copies.pop(block, None)
        if group is None:
            return
        group.discard(block)
        if len(group) == 1:
            (last,) = group
            del self.copies[last]
            self.pool.allocator.set_spare(group, False)
