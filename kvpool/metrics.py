"""Prometheus view of the pool, read from its books at scrape time so the hot path pays nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvpool.pool import Pool

COUNTERS: dict[str, tuple[str, str]] = {
    "alloc_requests": ("kvpool_alloc_requests", "alloc calls"),
    "alloc_blocks": ("kvpool_alloc_blocks", "blocks allocated"),
    "alloc_exhausted": ("kvpool_alloc_exhausted", "alloc calls refused for lack of room"),
    "free_requests": ("kvpool_free_requests", "free calls"),
    "free_blocks": ("kvpool_free_blocks", "block refs dropped by free"),
    "commit_requests": ("kvpool_commit_requests", "commit calls"),
    "committed_blocks": ("kvpool_prefix_committed_blocks", "blocks newly indexed for reuse"),
    "duplicate_blocks": ("kvpool_prefix_duplicate_blocks", "committed blocks whose content was already indexed"),
    "lookup_requests": ("kvpool_prefix_queries", "lookup calls"),
    "lookup_blocks": ("kvpool_prefix_query_blocks", "full blocks asked for by lookups"),
    "hit_blocks": ("kvpool_prefix_hit_blocks", "blocks found by lookups"),
    "handoffs": ("kvpool_handoffs", "handoffs parked"),
    "claims": ("kvpool_claims", "handoffs claimed"),
    "sessions_opened": ("kvpool_sessions_opened", "sessions opened"),
    "sessions_expired": ("kvpool_sessions_expired", "sessions whose lease ran out"),
    "handoffs_expired": ("kvpool_handoffs_expired", "handoffs released unclaimed"),
    "blocks_reclaimed": ("kvpool_blocks_reclaimed", "blocks released from expired sessions and handoffs"),
}


class PoolCollector(Collector):
    def __init__(self, get_pool: Callable[[], Pool]) -> None:
        self.get_pool = get_pool

    def collect(self) -> Iterator[Metric]:
        pool = self.get_pool()
        a = pool.allocator
        blocks = GaugeMetricFamily("kvpool_blocks", "blocks by state", labels=["state"])
        blocks.add_metric(["free"], a.num_free)
        blocks.add_metric(["in_use"], a.num_in_use)
        blocks.add_metric(["cached"], a.num_cached)
        yield blocks
        yield GaugeMetricFamily("kvpool_blocks_total", "blocks in the arena", value=pool.total_blocks)
        yield GaugeMetricFamily("kvpool_usage_ratio", "share of blocks in use", value=a.num_in_use / pool.total_blocks)
        yield GaugeMetricFamily("kvpool_sessions", "live sessions", value=len(pool.sessions))
        yield GaugeMetricFamily("kvpool_handoffs_parked", "handoffs waiting to be claimed", value=len(pool.handoffs))
        yield GaugeMetricFamily("kvpool_prefix_indexed_blocks", "blocks findable by hash", value=len(pool.index))
        yield CounterMetricFamily("kvpool_evictions", "cached blocks evicted for room", value=a.num_evictions)
        for field, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(pool.counters, field))
        refused = CounterMetricFamily(
            "kvpool_limits_exceeded", "calls refused (429) for a per-client limit, by setting", labels=["limit"]
        )
        for limit, count in sorted(pool.limits_exceeded.items()):
            refused.add_metric([limit], count)
        yield refused


def registry_for(get_pool: Callable[[], Pool]) -> CollectorRegistry:
    """A registry of its own per pool, so several pools in one process (tests) never collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(get_pool))
    return registry
