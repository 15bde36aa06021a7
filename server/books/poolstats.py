"""The books as ``/stats`` (and from it ``/metrics``) report them: blocks by state, per arena and per tier, counters.

A mixin of :class:`kvpool.server.books.pool.Pool`: it only reads what the pool keeps, so what the pool reports can grow
without the pool's logic growing with it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvpool.server.books.allocator import BlockAllocator
from kvpool.server.books.hosttier import HostTier
from kvpool.server.books.prefix import PrefixIndex
from kvpool.server.books.quarantine import Quarantine
from kvpool.server.books.records import Counters, Handoff, Session


class PoolStats:
    epoch: str
    allocator: BlockAllocator
    counters: Counters
    index: PrefixIndex
    sessions: dict[str, Session]
    handoffs: dict[str, Handoff]
    limits_exceeded: Counter[str]
    total_blocks: int
    arena_sizes: list[int]
    host_tier: HostTier | None
    quarantine: Quarantine | None

    def stats(self) -> dict[str, Any]:
        """Every block in one of free, in use, cached and quarantined (held back from a lapsed session's process,
        :mod:`kvpool.server.books.quarantine`: in use in the allocator's books, reported apart)."""
        a, c = self.allocator, self.counters
        fenced = self._quarantined()
        return {
            "epoch": self.epoch,
            "num_blocks": self.total_blocks,
            "free": a.num_free,
            "in_use": a.num_in_use - sum(fenced),
            "cached": a.num_cached,
            "quarantined": sum(fenced),
            "indexed": len(self.index),
            "sessions": len(self.sessions),
            "handoffs": len(self.handoffs),
            "hit_rate": c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0,
            "evictions": a.num_evictions,
            "counters": {name: getattr(c, name) for name in Counters.__slots__},
            "limits_exceeded": dict(self.limits_exceeded),
            "quarantine": self.quarantine.stats() if self.quarantine is not None else None,
            "arenas": [self._arena(i, fenced[i]) for i in range(len(self.arena_sizes))],
            "tiers": self._tiers(sum(fenced)),
        }

    def _quarantined(self) -> list[int]:
        """Quarantined blocks, per arena."""
        per = [0] * len(self.arena_sizes)
        if self.quarantine is not None:
            arena_of = self.allocator.arena_of
            for block in self.quarantine.blocks():
                per[arena_of[block]] += 1
        return per

    def _arena(self, i: int, quarantined: int) -> dict[str, int]:
        free, in_use, cached = self.allocator.counts(i)
        return {"free": free, "in_use": in_use - quarantined, "cached": cached, "quarantined": quarantined}

    def _tiers(self, quarantined: int) -> dict[str, dict[str, Any]]:
        """Each tier's books and hits: the arenas together ("gpu", also on the cpu backend), and the host tier."""
        a, hits = self.allocator, self.counters.hit_blocks
        gpu = {"num_blocks": a.num_blocks, "free": a.num_free, "in_use": a.num_in_use - quarantined,
               "cached": a.num_cached, "quarantined": quarantined}  # fmt: skip
        if self.host_tier is None:
            return {"gpu": {**gpu, "hit_blocks": hits}}
        host = self.host_tier.stats()
        return {"gpu": {**gpu, "hit_blocks": hits - host["hit_blocks"]}, "host": host}
