"""Helpers that read a pool's books from ``/stats``: every test here ends by checking them."""

from __future__ import annotations

from typing import Any

BOOK_KEYS = ("num_blocks", "free", "in_use", "cached", "indexed", "sessions", "handoffs")


def assert_balanced(stats: dict[str, Any]) -> None:
    """Every block is in exactly one of free, in use, cached: the invariant that no call may break."""
    free, in_use, cached, total = stats["free"], stats["in_use"], stats["cached"], stats["num_blocks"]
    assert min(free, in_use, cached) >= 0, stats
    assert free + in_use + cached == total, f"books do not balance: {free} + {in_use} + {cached} != {total}"


def books(stats: dict[str, Any]) -> dict[str, int]:
    """The state a rejected call must leave untouched (the request counters may move, the books may not)."""
    assert_balanced(stats)
    return {key: stats[key] for key in BOOK_KEYS}
