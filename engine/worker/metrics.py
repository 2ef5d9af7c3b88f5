"""Prometheus metrics of a worker (DESIGN.md §9), read from the engine thread's last snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.outputs import EngineStats


class EngineCollector(Collector):
    """Exposes engine counters at scrape time; cheap, lock-free (reads one snapshot object)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        counters: Callable[[], dict[str, int]],
        model: str,
        role: str,
    ) -> None:
        self._stats = stats
        self._counters = counters
        self._labels = [model, role]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        c = self._counters()
        names = ["model", "role"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self._labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(self._labels, value)
            return m

        yield gauge("tandem_requests_running", "Requests in the running batch", s.num_running)
        yield gauge("tandem_requests_waiting", "Requests queued for admission", s.num_waiting)
        yield gauge("tandem_kv_cache_usage_ratio", "Fraction of KV blocks in use", s.kv_usage)
        yield gauge("tandem_kv_cache_free_blocks", "KV blocks free or evictable", s.num_free_blocks)
        yield counter(
            "tandem_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_queried_tokens,
        )
        yield counter(
            "tandem_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache",
            s.prefix_hit_tokens,
        )
        yield counter("tandem_prompt_tokens", "Prompt tokens computed", c["prompt_tokens"])
        yield counter("tandem_generation_tokens", "Tokens generated", c["generation_tokens"])
        preempted = CounterMetricFamily(
            "tandem_preemptions",
            "Requests preempted for lack of KV blocks, by how their KV was kept",
            labels=[*names, "mode"],
        )
        preempted.add_metric([*self._labels, "swap"], s.num_swap_preemptions)
        preempted.add_metric(
            [*self._labels, "recompute"], s.num_preemptions - s.num_swap_preemptions
        )
        yield preempted
        tier = s.host_tier
        if tier is None:
            return
        yield gauge("tandem_kv_host_tier_blocks", "Blocks in the host KV tier", tier.num_blocks)
        yield gauge(
            "tandem_kv_host_tier_usage_ratio", "Fraction of host KV tier blocks in use", tier.usage
        )
        yield counter(
            "tandem_prefix_cache_host_hit_tokens",
            "Prompt tokens whose KV was loaded from the host tier (also in the hit tokens)",
            tier.hit_tokens,
        )
        yield counter(
            "tandem_kv_host_tier_offloaded_blocks", "Blocks copied to the host tier",
            tier.offloaded_blocks,
        )  # fmt: skip
        yield counter(
            "tandem_kv_host_tier_loaded_blocks", "Blocks copied back from the host tier",
            tier.loaded_blocks,
        )  # fmt: skip
        failures = CounterMetricFamily(
            "tandem_kv_host_tier_integrity_failures",
            "Host tier blocks refused by a load's checks (the request recomputed them)",
            labels=[*names, "reason"],
        )
        for reason, n in tier.integrity_failures:
            failures.add_metric([*self._labels, reason], n)
        yield failures


def worker_registry(
    stats: Callable[[], EngineStats], counters: Callable[[], dict[str, int]], model: str, role: str
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, counters, model, role))
    return registry
