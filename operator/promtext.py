"""Prometheus text exposition: parsed snapshots and histogram quantiles from bucket deltas.

Used by the direct metrics source, which scrapes pods itself: two snapshots of one pod, taken an
interval apart, give counter rates and the histogram of just that interval (as PromQL's
`histogram_quantile(q, rate(..._bucket[w]))` would). Pure; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

LabelSet = frozenset[tuple[str, str]]
Matcher = Callable[[Mapping[str, str]], bool]


class ExpositionError(ValueError):
    """The text is not valid Prometheus exposition format."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every sample of one scrape, keyed by (sample name, labels)."""

    samples: Mapping[tuple[str, LabelSet], float]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        samples: dict[tuple[str, LabelSet], float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        except ValueError as exc:
            raise ExpositionError(f"invalid exposition text: {exc}") from exc
        return cls(samples)

    def select(self, name: str, match: Matcher | None = None) -> dict[LabelSet, float]:
        return {
            labels: value
            for (sample_name, labels), value in self.samples.items()
            if sample_name == name and (match is None or match(dict(labels)))
        }

    def total(self, name: str, match: Matcher | None = None) -> float:
        return sum(self.select(name, match).values())

    def mean(self, name: str, match: Matcher | None = None) -> float | None:
        values = list(self.select(name, match).values())
        return sum(values) / len(values) if values else None


def counter_delta(
    before: Snapshot, after: Snapshot, name: str, match: Matcher | None = None
) -> float:
    """Increase of a counter between two scrapes; a series that went down restarted from 0."""
    old = before.select(name, match)
    total = 0.0
    for labels, value in after.select(name, match).items():
        prev = old.get(labels, 0.0)
        total += value if value < prev else value - prev
    return total


def _bucket_bound(labels: LabelSet) -> tuple[float, LabelSet]:
    rest = frozenset((k, v) for k, v in labels if k != "le")
    le = dict(labels).get("le")
    if le is None:
        raise ExpositionError("histogram bucket without an le label")
    return float(le), rest


def bucket_deltas(
    before: Snapshot, after: Snapshot, histogram: str, match: Matcher | None = None
) -> dict[float, float]:
    """Per-upper-bound cumulative counts observed between two scrapes, summed over series.

    A series whose +Inf count went down was reset (the process restarted); its whole current
    count is the delta, as Prometheus' rate() treats resets.
    """
    name = f"{histogram}_bucket"
    old = before.select(name, match)
    new = after.select(name, match)
    reset: set[LabelSet] = set()
    for labels, value in new.items():
        bound, rest = _bucket_bound(labels)
        if math.isinf(bound) and value < old.get(labels, 0.0):
            reset.add(rest)
    out: dict[float, float] = {}
    for labels, value in new.items():
        bound, rest = _bucket_bound(labels)
        delta = value if rest in reset else value - old.get(labels, 0.0)
        out[bound] = out.get(bound, 0.0) + max(delta, 0.0)
    return out


def merge_buckets(parts: Iterable[Mapping[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for part in parts:
        for bound, count in part.items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts {upper bound: count}.

    Linear interpolation inside the bucket that holds the rank; the lowest bucket interpolates
    from 0; a rank in the +Inf bucket returns the largest finite bound. None when empty.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not buckets or math.inf not in buckets:
        return None
    bounds = sorted(buckets)
    counts = [buckets[b] for b in bounds]
    # Cumulative counts can be non-monotonic after summing scrapes with different timing;
    # Prometheus fixes this the same way.
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    for i, bound in enumerate(bounds):
        if counts[i] >= rank:
            if math.isinf(bound):
                return bounds[-2] if len(bounds) > 1 else None
            lower = bounds[i - 1] if i > 0 else 0.0
            below = counts[i - 1] if i > 0 else 0.0
            in_bucket = counts[i] - below
            if in_bucket <= 0:
                return bound
            return lower + (bound - lower) * (rank - below) / in_bucket
    return bounds[-2] if len(bounds) > 1 else None
