"""The host tier's books: prefix blocks evicted from the GPU arena live on in host memory, still findable.

When the arena's allocator evicts a cached prefix block, its index node is not dropped but detached from the block
and queued; before the allocator hands the blocks it took to anyone (whoever asked: an alloc, a slab's refill, a
restore), it calls :meth:`HostTier.flush`, which copies the whole queue to host blocks in one batch, and the nodes
stay in the prefix index under the same keys, now pointing at host blocks. A lookup whose verified chain reaches
nodes on the host gets arena blocks allocated for them, the KV copied back, and the nodes moved back to the arena
before it answers: the worker receives ready blocks, as on a GPU hit.

The tiers are exclusive: a node's KV is in the arena or on the host, never both, so each tier's books are those of
the one tier: ``free + in_use + cached == num_blocks``, where a host block is in use only while a restore reads it.
The host tier evicts least recently used first, and chains enter it tail first (the order the arena evicts
them), so a chain's tail leaves before the prefix it hangs on. A node whose parent is gone is never copied: no
lookup could reach it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.server.books.allocator import BlockAllocator
from kvpool.server.books.prefix import PrefixIndex, _Node


@dataclass
class TierCounters:
    host_hit_blocks: int = 0
    host_evictions: int = 0
    offload_skipped: int = 0  # evicted blocks not copied: their chain was already broken, or no room


class Copier(Protocol):
    """What the books ask of the copies (``tiers.tiercopy.TierCopier``), so that the books stay free of torch."""

    totals: Any

    def offload(self, arena: int, device_ids: Sequence[int], host_ids: Sequence[int]) -> None: ...

    def restore(self, arena: int, host_ids: Sequence[int], device_ids: Sequence[int]) -> None: ...


class HostTier:
    def __init__(self, num_blocks: int, copier: Copier) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.copier = copier
        self.counters = TierCounters()
        self._free = list(range(num_blocks))  # a heap: the lowest ids first, so that batches get long runs
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # host block -> node, least recently used first
        self._restoring: dict[int, _Node] = {}  # host blocks a restore reads now
        self.host_of: dict[_Node, int] = {}
        self._pending: list[tuple[_Node, int]] = []  # (node, arena block) evicted, not copied yet
        self.index = PrefixIndex()
        self.allocator: BlockAllocator | None = None

    def bind(self, index: PrefixIndex, allocator: BlockAllocator) -> None:
        self.index, self.allocator = index, allocator

    # -- counts ---------------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int]:
        """(free, in_use, cached) of the host tier."""
        return len(self._free), len(self._restoring), len(self._lru)

    # -- eviction to the host -------------------------------------------------------------------------

    def evicted(self, block: int) -> None:
        """The allocator evicted ``block``: keep its node findable and queue its KV for the host."""
        node = self.index._by_block.pop(block, None)
        if node is None:
            return
        if self._live(node):
            self._pending.append((node, block))
        else:
            self._forget(node)

    def flush(self) -> None:
        """Copy every block queued since the last flush to the host, in one batch per arena: the allocator calls
        this before the blocks it evicted reach their next holder."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        keep = []
        for node, block in pending:
            if self._live(node):
                keep.append((node, block))
            else:
                self._forget(node)
        room = self.num_blocks - len(self._restoring)
        if len(keep) > room:  # more than the host holds: keep the last evicted, the heads of their chains
            for node, _ in keep[: len(keep) - room]:
                self._forget(node)
            keep = keep[len(keep) - room :]
        self.counters.offload_skipped += len(pending) - len(keep)
        while len(self._free) < len(keep):
            host, old = self._lru.popitem(last=False)
            del self.host_of[old]
            self._forget(old)
            self.counters.host_evictions += 1
            heapq.heappush(self._free, host)
        hosts = [heapq.heappop(self._free) for _ in keep]
        assert self.allocator is not None
        arena_of, starts = self.allocator.arena_of, self.allocator.starts
        by_arena: dict[int, tuple[list[int], list[int]]] = {}
        for (_, block), host in zip(keep, hosts, strict=True):
            a = arena_of[block]
            local, targets = by_arena.setdefault(a, ([], []))
            local.append(block - starts[a])
            targets.append(host)
        try:
            for a, (local, targets) in by_arena.items():
                self.copier.offload(a, local, targets)
        except BaseException:  # their KV did not reach the host: forget them, or a lookup would find stale blocks
            for node, _ in keep:
                self._forget(node)
            for host in hosts:
                heapq.heappush(self._free, host)
            raise
        for (node, _), host in zip(keep, hosts, strict=True):
            self.host_of[node] = host
            self._lru[host] = node

    # -- lookup -----------------------------------------------------------------------------------------

    def lookup(self, holder: str, blocks: Iterable[tuple[bytes, bytes]], arena: int) -> tuple[list[int], int]:
        """Arena blocks of the longest verified prefix, restoring the part on the host; (ids, host hits)."""
        assert self.allocator is not None
        alloc, host_of = self.allocator, self.host_of
        nodes = self.index.match_nodes(blocks)
        room = alloc.available(arena)
        take, on_host = 0, 0
        for node in nodes:
            if node in host_of:
                if on_host + 1 > room:
                    break
                on_host += 1
            elif alloc.ref_cnt[node.block] == 0:
                if on_host > room - 1:
                    break
                room -= 1  # taking a ref removes a cached block from what the restore may evict
            take += 1
        nodes = nodes[:take]
        alloc.acquire(holder, [n.block for n in nodes if n not in host_of])
        if not on_host:
            return [n.block for n in nodes], 0
        restoring = [n for n in nodes if n in host_of]
        hosts = [host_of[n] for n in restoring]
        for node, host in zip(restoring, hosts, strict=True):
            del self._lru[host]
            self._restoring[host] = node
        fresh: list[int] = []
        try:
            fresh = alloc.allocate(holder, len(restoring), arena)  # flushes what it evicts first
            self.copier.restore(arena, hosts, [b - alloc.starts[arena] for b in fresh])
        except BaseException:  # the KV stays on the host, findable; the caller gets nothing
            for node, host in zip(restoring, hosts, strict=True):
                del self._restoring[host]
                self._lru[host] = node
            alloc.free(holder, [*(n.block for n in nodes if n not in host_of), *fresh])
            raise
        for node, host, block in zip(restoring, hosts, fresh, strict=True):
            del self._restoring[host]
            del host_of[node]
            heapq.heappush(self._free, host)
            node.block = block
            self.index._by_block[block] = node
        alloc.mark_committed(fresh)
        self.counters.host_hit_blocks += len(restoring)
        return [n.block for n in nodes], len(restoring)

    # -- helpers ----------------------------------------------------------------------------------------

    def _live(self, node: _Node) -> bool:
        """Whether a lookup can still reach the node: its key maps to it and its parent is live too (or none)."""
        nodes = self.index._nodes
        return nodes.get(node.key) is node and (node.parent is None or nodes.get(node.parent.key) is node.parent)

    def _forget(self, node: _Node) -> None:
        nodes = self.index._nodes
        if nodes.get(node.key) is node:
            del nodes[node.key]
            if self.index.listener is not None:  # a router must learn that the key finds nothing now
                self.index.listener.removed(node)

    def stats(self) -> dict[str, Any]:
        free, in_use, cached = self.counts()
        t, c = self.copier.totals, self.counters
        return {
            "num_blocks": self.num_blocks,
            "free": free,
            "in_use": in_use,
            "cached": cached,
            "hit_blocks": c.host_hit_blocks,
            "evictions": c.host_evictions,
            "offload_skipped": c.offload_skipped,
            "offloaded_blocks": t.offloaded_blocks,
            "restored_blocks": t.restored_blocks,
            "offloaded_bytes": t.offloaded_bytes,
            "restored_bytes": t.restored_bytes,
            "offload_seconds": t.offload_s,
            "restore_seconds": t.restore_s,
            "offload_bytes_per_s": t.bandwidth("offload"),
            "restore_bytes_per_s": t.bandwidth("restore"),
        }

    def check(self) -> None:
        """Assert the host tier's invariants; the tests call this after each step."""
        free, lru, restoring = set(self._free), set(self._lru), set(self._restoring)
        assert len(free) == len(self._free), "a host block is free twice"
        assert not (free & lru or free & restoring or lru & restoring), "a host block is in two states"
        assert len(free) + len(lru) + len(restoring) == self.num_blocks, "the host tier's books do not balance"
        assert not self._pending, "evicted blocks were left uncopied"
        assert {self.host_of[n] for n in self._lru.values()} == lru
        for host, node in self._lru.items():
            assert self.host_of[node] == host
