"""Order statistics of timing samples: what every suite's tables and JSON report, computed one way."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_ns(samples_ns: Iterable[int]) -> dict[str, float]:
    """n, mean, min, p50, p90, p99 and max of nanosecond samples, in microseconds."""
    values = sorted(samples_ns)
    if not values:
        return {"n": 0}
    us = [v / 1e3 for v in values]
    return {
        "n": len(us),
        "mean_us": sum(us) / len(us),
        "min_us": us[0],
        "p50_us": percentile(us, 50),
        "p90_us": percentile(us, 90),
        "p99_us": percentile(us, 99),
        "max_us": us[-1],
    }


def thin(samples: Sequence[int], limit: int = 1000) -> list[int]:
    """At most ``limit`` evenly strided samples (in their measured order), so the raw JSON stays small."""
    if len(samples) <= limit:
        return list(samples)
    step = len(samples) / limit
    return [samples[int(i * step)] for i in range(limit)]


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """Items starting at position ``k``: each round starts with another variant, so none always runs first."""
    k %= max(1, len(items))
    return [*items[k:], *items[:k]]
