"""Prometheus scraping: one-off reads of a worker's or router's ``/metrics`` and a sampler that
records chosen series from several targets on a fixed period while a benchmark runs."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple], float]


def parse(text: str) -> Samples:
    """Prometheus text as {(sample name, sorted labels): value}."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    """Prometheus text at ``url`` as {(sample name, sorted labels): value}."""
    return parse(httpx.get(url, timeout=10, headers=headers).text)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def list_workers(internal_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The registered workers, from the router's internal listener (cluster-token headers)."""
    r = httpx.get(f"{internal_url}/internal/workers", timeout=10, headers=headers)
    r.raise_for_status()
    return r.json()["workers"]


def histogram(samples: Samples, name: str) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` summed over its series: [(le, count)], by le."""
    buckets: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    return sorted(buckets.items())


def histogram_quantile(q: float, before: Samples, after: Samples, name: str) -> float:
    """Prometheus's ``histogram_quantile`` over what histogram ``name`` counted between two
    scrapes: linear within the bucket holding the q-th observation, so only as fine as the
    buckets; nan when nothing was counted."""
    start = dict(histogram(before, name))
    buckets = [(le, c - start.get(le, 0.0)) for le, c in histogram(after, name)]
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank, prev_le, prev_c = q * buckets[-1][1], 0.0, 0.0
    for le, c in buckets:
        if c >= rank and c > prev_c:
            if math.isinf(le):  # beyond the last bound: its lower edge, as Prometheus answers
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


@dataclass(slots=True)
class Series:
    """One target's samples: ``times[i]`` (seconds on the sampler's clock) and ``values[i]``,
    each {metric name: value summed over its label sets}; buckets keep their ``le`` in the key."""

    times: list[float] = field(default_factory=list)
    values: list[dict[str, float]] = field(default_factory=list)


def select(samples: Samples, names: Iterable[str]) -> dict[str, float]:
    """The samples whose name is in ``names`` (or is a bucket of one), summed over other labels;
    a bucket's key is ``name_bucket{le}``."""
    wanted = set(names)
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        base = n.removesuffix("_bucket")
        if n not in wanted and base not in wanted:
            continue
        key = f"{n}{{{dict(labels)['le']}}}" if n.endswith("_bucket") else n
        out[key] = out.get(key, 0.0) + v
    return out


class Sampler:
    """Scrapes ``targets`` ({name: metrics URL}) every ``period_s`` on a daemon thread between
    ``start()`` and ``stop()``; a failed scrape is counted, not raised (a worker under load may be
    slow to answer, and a gap in the record is better than a dead benchmark)."""

    def __init__(self, targets: dict[str, str], names: Iterable[str], period_s: float = 0.5,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.targets = dict(targets)
        self.names = tuple(names)
        self.period_s = period_s
        self.headers = headers
        self.series = {t: Series() for t in self.targets}
        self.failures = 0
        self.t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.t0 = time.time()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=max(2.0, self.period_s * 4), headers=self.headers) as client:
            while not self._stop.is_set():
                tick = time.monotonic()
                for name, url in self.targets.items():
                    try:
                        samples = parse(client.get(url).text)
                    except (httpx.HTTPError, ValueError):
                        self.failures += 1
                        continue
                    s = self.series[name]
                    s.times.append(time.time())
                    s.values.append(select(samples, self.names))
                self._stop.wait(max(0.0, self.period_s - (time.monotonic() - tick)))

    def stop(self) -> dict[str, Series]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.series
