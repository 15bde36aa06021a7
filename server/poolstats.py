"""The books as ``/stats`` (and from it ``/metrics``) report them: blocks by state, per arena and per tier, counters.

A mixin of :class:`kvpool.server.pool.Pool`: it only reads what the pool keeps, so what the pool reports can grow
without the pool's logic growing with it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvpool.server.allocator import BlockAllocator
from kvpool.server.hosttier import HostTier
from kvpool.server.prefix import PrefixIndex
from kvpool.server.records import Counters, Handoff, Session


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

    def stats(self) -> dict[str, Any]:
        a, c = self.allocator, self.counters
        return {
            "epoch": self.epoch,
            "num_blocks": self.total_blocks,
            "free": a.num_free,
            "in_use": a.num_in_use,
            "cached": a.num_cached,
            "indexed": len(self.index),
            "sessions": len(self.sessions),
            "handoffs": len(self.handoffs),
            "hit_rate": c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0,
            "evictions": a.num_evictions,
            "counters": {name: getattr(c, name) for name in Counters.__slots__},
            "limits_exceeded": dict(self.limits_exceeded),
            "arenas": [
                dict(zip(("free", "in_use", "cached"), a.counts(i), strict=True)) for i in range(len(self.arena_sizes))
            ],
            "tiers": self._tiers(),
        }

    def _tiers(self) -> dict[str, dict[str, Any]]:
        """Each tier's books and hits: the arenas together ("gpu", also on the cpu backend), and the host tier."""
        a, hits = self.allocator, self.counters.hit_blocks
        gpu = {"num_blocks": a.num_blocks, "free": a.num_free, "in_use": a.num_in_use, "cached": a.num_cached}
        if self.host_tier is None:
            return {"gpu": {**gpu, "hit_blocks": hits}}
        host = self.host_tier.stats()
        return {"gpu": {**gpu, "hit_blocks": hits - host["hit_blocks"]}, "host": host}
