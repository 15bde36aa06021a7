"""Prometheus view of the pool, read from its stats at scrape time so the hot path pays nothing for it."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

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
    "handoffs_orphaned": (
        "kvpool_handoffs_orphaned",
        "addressed handoffs refused and released because their addressee ended before it claimed them",
    ),
    "blocks_reclaimed": ("kvpool_blocks_reclaimed", "blocks released from expired sessions and handoffs"),
    "stale_refused": ("kvpool_stale_refused", "calls refused (409) for naming stale block ids"),
    "stale_ids": ("kvpool_stale_ids", "stale block ids named in refused calls"),
    "peer_copies": ("kvpool_peer_copies", "lookups served in part by copying prefix blocks from another GPU's arena"),
    "peer_copied_blocks": ("kvpool_peer_copied_blocks", "prefix blocks copied from one GPU's arena to another's"),
}

#: the fence's counters (kvpool.server.books.quarantine)
QUARANTINE: dict[str, tuple[str, str]] = {
    "quarantines": ("kvpool_quarantines", "lapsed sessions whose uncommitted blocks were quarantined"),
    "released": ("kvpool_quarantines_released", "quarantines released because their process was gone"),
    "killed": ("kvpool_lapsed_killed", "lapsed sessions' processes sent SIGKILL (--lapsed-sessions kill)"),
    "kills_refused": ("kvpool_lapsed_kills_refused", "lapsed processes the pool may not kill: quarantined instead"),
}

#: the KV-event feed's counters (present when --kv-events-endpoint is set)
KV_EVENTS: dict[str, tuple[str, str]] = {
    "published": ("kvpool_kv_events_published", "KV events sent to subscribers"),
    "batches": ("kvpool_kv_event_batches_published", "KV event batches sent (each one sequence number)"),
    "dropped": ("kvpool_kv_events_dropped", "KV events dropped because the queue was full"),
    "replay_requests": ("kvpool_kv_event_replay_requests", "replay requests served"),
}


class PoolCollector(Collector):
    """Reads the same snapshot as ``GET /stats`` (the plane's), so the two never disagree."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        blocks = GaugeMetricFamily("kvpool_blocks", "blocks by state", labels=["state"])
        for state in ("free", "in_use", "cached", "quarantined"):
            blocks.add_metric([state], s[state])
        yield blocks
        yield GaugeMetricFamily("kvpool_arena_blocks", "blocks in the arena", value=s["num_blocks"])
        yield GaugeMetricFamily("kvpool_usage_ratio", "share of blocks in use", value=s["in_use"] / s["num_blocks"])
        yield GaugeMetricFamily("kvpool_sessions", "live sessions", value=s["sessions"])
        yield GaugeMetricFamily("kvpool_handoffs_parked", "handoffs waiting to be claimed", value=s["handoffs"])
        yield GaugeMetricFamily("kvpool_prefix_indexed_blocks", "blocks findable by hash", value=s["indexed"])
        yield CounterMetricFamily("kvpool_evictions", "cached blocks evicted for room", value=s["evictions"])
        for field, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=s["counters"][field])
        refused = CounterMetricFamily(
            "kvpool_limits_exceeded",
            "calls refused, and connections refused or closed, for a per-client limit, by setting",
            labels=["limit"],
        )
        for limit, count in sorted(s["limits_exceeded"].items()):
            refused.add_metric([limit], count)
        yield refused
        fence = s.get("quarantine")
        if fence is not None:
            yield GaugeMetricFamily("kvpool_quarantined_blocks", "blocks held back from lapsed sessions' live "
                                    "processes (--lapsed-sessions)", value=fence["blocks"])  # fmt: skip
            for field, (name, doc) in QUARANTINE.items():
                yield CounterMetricFamily(name, doc, value=fence[field])
        events = s.get("kv_events")
        if events is not None:
            for field, (name, doc) in KV_EVENTS.items():
                yield CounterMetricFamily(name, doc, value=events[field])
            yield GaugeMetricFamily("kvpool_kv_events_pending", "KV events not sent yet", value=events["pending"])
        slabs = s.get("slabs")
        if slabs is not None:
            slab = GaugeMetricFamily("kvpool_slab_blocks", "blocks in reservation slabs, by state", labels=["state"])
            for state in ("idle", "allocated", "handed", "in_flight"):
                slab.add_metric([state], slabs[f"slab_{state}"])
            yield slab
            yield GaugeMetricFamily("kvpool_slab_regions", "sessions holding a slab", value=slabs["regions"])
            c = slabs["counters"]
            yield CounterMetricFamily("kvpool_slab_handed_settled", "handed slab blocks moved to their consumer",
                                      value=c["handed_settled"])  # fmt: skip
            yield CounterMetricFamily("kvpool_slab_wants_raised", "slabs asked for their idle blocks back",
                                      value=c["wants_raised"])  # fmt: skip
        yield from tier_metrics(s["tiers"])


def tier_metrics(tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per tier ("gpu": the arenas, "host": the host tier if the pool has one): blocks, hits, bytes copied."""
    blocks = GaugeMetricFamily("kvpool_tier_blocks", "blocks by tier and state", labels=["tier", "state"])
    hits = CounterMetricFamily("kvpool_tier_hit_blocks", "blocks found by lookups, by the tier they were in",
                               labels=["tier"])  # fmt: skip
    for tier, t in tiers.items():
        for state in ("free", "in_use", "cached", "quarantined"):
            if state in t:
                blocks.add_metric([tier, state], t[state])
        hits.add_metric([tier], t["hit_blocks"])
    yield blocks
    yield hits
    host = tiers.get("host")
    if host is None:
        return
    moved = CounterMetricFamily("kvpool_host_tier_copied_bytes", "bytes copied to (offload) and from (restore) the "
                                "host tier", labels=["direction"])  # fmt: skip
    took = CounterMetricFamily("kvpool_host_tier_copy_seconds", "seconds the host tier's copies took",
                               labels=["direction"])  # fmt: skip
    rate = GaugeMetricFamily("kvpool_host_tier_copy_bytes_per_second", "bytes per second over every copy so far",
                             labels=["direction"])  # fmt: skip
    for direction, done in (("offload", "offloaded"), ("restore", "restored")):
        moved.add_metric([direction], host[f"{done}_bytes"])
        took.add_metric([direction], host[f"{direction}_seconds"])
        rate.add_metric([direction], host[f"{direction}_bytes_per_s"])
    yield moved
    yield took
    yield rate
    yield CounterMetricFamily("kvpool_host_tier_evictions", "host blocks evicted for room", value=host["evictions"])


#: the control plane's operations whose latency is measured, over HTTP and the fast channel alike
TIMED = ("open_session", "close_session", "heartbeat", "alloc", "free", "commit", "lookup", "handoff", "claim",
         "accept")  # fmt: skip
#: from a fast-channel call (tens of microseconds) to a claim that waits for its handoff
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0, 5.0, 30.0)


def registry_for(get_stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own per pool, so several pools in one process (tests) never collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(get_stats))
    return registry


def time_operations(plane: Any, registry: CollectorRegistry) -> None:
    """Measure each operation of ``plane`` in a per-operation histogram, errors included.

    The plane's methods are wrapped on the instance, so both transports, which look them up on the plane, are
    measured without either knowing.
    """
    histogram = Histogram(
        "kvpool_operation_duration_seconds",
        "time the pool took to answer an operation, from parsed request to reply (claims include their wait)",
        ["operation"],
        registry=registry,
        buckets=LATENCY_BUCKETS,
    )
    for name in TIMED:
        setattr(plane, name, _timed(getattr(plane, name), histogram.labels(name)))


def _timed(method: Callable[..., Any], child: Any) -> Callable[..., Any]:
    observe, clock = child.observe, time.perf_counter
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return await method(*args, **kwargs)
            finally:
                observe(clock() - start)

        return timed_async

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            observe(clock() - start)

    return timed
