"""The pool's KV-event feed, wired from its settings, and its prefix index as the feed names it.

A router that missed no event holds exactly :func:`index_listing`: that is what ``GET /prefix/blocks`` answers,
for an operator asking what a node holds and for the tests that rebuild the index from the stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvpool.server.books.prefix import PrefixIndex
from kvpool.server.config import PoolSettings
from kvpool.server.events.kvevents import MEDIUM_CPU, MEDIUM_GPU, HashForm, IndexEvents, external_hash, rank_of


def media_of(backend: str, num_arenas: int) -> list[str]:
    """Each arena's medium in events: GPU memory for the cuda backend, host memory (/dev/shm) for cpu."""
    return [MEDIUM_GPU if backend == "cuda" else MEDIUM_CPU] * num_arenas


class KVEventsFeed:
    """The publisher and the index listener that feeds it; a new pool's first events clear every rank."""

    def __init__(self, settings: PoolSettings, sizes: Sequence[int], backend: str) -> None:
        from kvpool.server.events.publisher import EventPublisher  # ZeroMQ is loaded only by a pool that publishes

        assert settings.kv_events_endpoint is not None
        self.publisher = EventPublisher(
            settings.kv_events_endpoint,
            replay_endpoint=settings.kv_events_replay_endpoint,
            topic=settings.kv_events_topic,
            buffer_steps=settings.kv_events_buffer_steps,
            queue_size=settings.kv_events_queue_size,
            hwm=settings.kv_events_hwm,
            hashes=settings.kv_events_hashes,
            form=settings.kv_events_form,
            mode=settings.kv_events_mode,
        )
        starts = list(itertools.accumulate(sizes, initial=0))[:-1]
        self.listener = IndexEvents(self.publisher.put, settings.block_size, starts, media_of(backend, len(sizes)))
        # A router may still hold what this node's previous pool published: a restarted pool starts empty.
        for rank in range(len(sizes)):
            self.listener.cleared(rank)

    def stats(self) -> dict[str, Any]:
        return self.publisher.stats()

    def close(self) -> None:
        self.publisher.close()


def index_listing(
    index: PrefixIndex, starts: Sequence[int], media: Sequence[str], hashes: HashForm, limit: int
) -> dict[str, Any]:
    """The findable blocks as events name them (hash, parent hash, rank, medium), ``limit`` at most.

    ``starts`` are the arenas' first block ids, ``media`` their media, as :class:`IndexEvents` takes them.
    """

    def named(key: bytes) -> int | str:
        value = external_hash(key, hashes)
        return value.hex() if isinstance(value, bytes) else value

    blocks = []
    for node in itertools.islice(index.findable(), limit + 1):
        rank = rank_of(starts, node.block)
        parent = node.parent.key if node.parent is not None else None
        blocks.append({"hash": named(node.key), "parent": None if parent is None else named(parent),
                       "rank": rank, "medium": media[rank]})  # fmt: skip
    return {"hashes": hashes, "blocks": blocks[:limit], "truncated": len(blocks) > limit}
