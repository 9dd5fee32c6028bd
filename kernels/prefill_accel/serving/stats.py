"""Summary statistics of latency samples: percentiles with linear interpolation between order statistics."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating linearly between the two nearest ranks
    (numpy's default method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """Median (= p50), p90, p99, mean, min and max; all None for no values (JSON has no NaN)."""
    if not values:
        return dict.fromkeys(("median", "p90", "p99", "mean", "min", "max"))
    return {"median": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values), "min": min(values), "max": max(values)}
