"""Latency statistics: percentiles of samples, quantiles of Prometheus histograms (as PromQL's
``histogram_quantile``), histogram deltas between two scrapes, and empirical CDFs. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

Buckets = list[tuple[float, float]]  # cumulative (le, count), sorted by le, +Inf last


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 <= p <= 100; NaN for no samples."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bucket_delta(after: Buckets, before: Buckets) -> Buckets:
    """Observations between two scrapes of one histogram (``before`` may be empty)."""
    prior = dict(before)
    return [(le, count - prior.get(le, 0.0)) for le, count in after]


def histogram_quantile(q: float, buckets: Buckets) -> float:
    """PromQL's estimate: linear within the bucket holding rank ``q * total``; the highest finite
    bound when the rank falls in +Inf; NaN for an empty histogram."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def cdf(xs: Sequence[float], points: int = 200) -> tuple[list[float], list[float]]:
    """An empirical CDF thinned to about ``points`` steps: (sorted values, cumulative fractions)."""
    s = sorted(xs)
    if not s:
        return [], []
    step = max(1, len(s) // points)
    idx = list(range(0, len(s), step))
    if idx[-1] != len(s) - 1:
        idx.append(len(s) - 1)
    return [s[i] for i in idx], [(i + 1) / len(s) for i in idx]
