"""Helpers that read a pool's books from ``/stats``: every test here ends by checking them."""

from __future__ import annotations

from typing import Any

BOOK_KEYS = ("num_blocks", "free", "in_use", "cached", "quarantined", "indexed", "sessions", "handoffs")


def assert_balanced(stats: dict[str, Any]) -> None:
    """Every block is in exactly one of free, in use, cached, quarantined (held back from a lapsed session's live
    process): the invariant that no call may break, for the whole pool and for each arena."""
    for books in [stats, *stats["arenas"]]:
        free, in_use, cached, fenced = books["free"], books["in_use"], books["cached"], books["quarantined"]
        total = books.get("num_blocks", free + in_use + cached + fenced)
        assert min(free, in_use, cached, fenced) >= 0, stats
        assert free + in_use + cached + fenced == total, (
            f"books do not balance: {free} + {in_use} + {cached} + {fenced} != {total}"
        )
    assert sum(sum(arena.values()) for arena in stats["arenas"]) == stats["num_blocks"], stats


def books(stats: dict[str, Any]) -> dict[str, int]:
    """The state a rejected call must leave untouched (the request counters may move, the books may not)."""
    assert_balanced(stats)
    return {key: stats[key] for key in BOOK_KEYS}
