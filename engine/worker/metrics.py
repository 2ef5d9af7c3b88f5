"""Prometheus metrics of a worker (DESIGN.md §9), read from the engine thread's last snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.outputs import EngineStats, RequestTimings

# A worker's phases are shorter than the router's whole request: finer at the low end, and
# at most 1.5x apart up to 3 s, so a p90 read from them (histogram_quantile) is within ~20 %.
_PHASE_BUCKETS = (
    0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01,
    0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TOTAL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class EngineCollector(Collector):
    """Exposes engine counters at scrape time; cheap, lock-free (reads one snapshot object)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        counters: Callable[[], dict[str, float]],
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
        yield counter(
            "tandem_worker_busy_seconds",
            "Wall seconds of engine steps that ran the model (rate: the engine's utilization)",
            c["busy_seconds"],
        )
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
    stats: Callable[[], EngineStats],
    counters: Callable[[], dict[str, float]],
    model: str,
    role: str,
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, counters, model, role))
    return registry


class RequestLatency:
    """Where a worker's requests spend their time, observed as each one ends (its final output's
    ``RequestTimings``), labelled ``model`` and ``role``. Beside the router's end-to-end TTFT
    they split a slow first token between the worker (queue, compute) and the serving path.
    Owned by the WorkerService; ``observe`` runs on the event loop, in each request's stream."""

    def __init__(self, registry: CollectorRegistry, model: str, role: str) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name, doc, ["model", "role"], buckets=buckets, registry=registry
            ).labels(model, role)

        self.queue = histogram(
            "tandem_worker_queue_time_seconds",
            "Arrival at the worker to first admission by its scheduler (decode: the KV pull "
            "starts)",
            _PHASE_BUCKETS,
        )
        self.first_token = histogram(
            "tandem_worker_time_to_first_token_seconds",
            "Arrival at the worker to the first token it sampled (prefill: the hand-off token; "
            "decode: after the KV pull, its first step)",
            _PHASE_BUCKETS,
        )
        self.total = histogram(
            "tandem_worker_request_duration_seconds",
            "Arrival at the worker to the request's end there",
            _TOTAL_BUCKETS,
        )

    def observe(self, timings: RequestTimings | None) -> None:
        if timings is None:
            return
        queue, first = timings.queue_seconds, timings.first_token_seconds
        if queue is not None:
            self.queue.observe(queue)
        if first is not None:
            self.first_token.observe(first)
        self.total.observe(timings.total_seconds)
