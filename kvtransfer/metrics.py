"""Prometheus metrics of the KV connector (names from DESIGN.md section 9).

The worker service creates one ``KVTransferMetrics`` on its registry and passes it to
``create_connector``; the connector only increments/observes, from its own threads
(prometheus_client metrics are thread-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from tandem.engine.kv_connector import FailureReason

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class KVTransferMetrics:
    bytes_total: Counter  # labels: model, role, direction, transport
    seconds: Histogram  # labels: model, role, transport
    failures_total: Counter  # labels: model, role, reason
    model: str
    role: str

    def add_bytes(self, direction: str, transport: str, nbytes: int) -> None:
        self.bytes_total.labels(self.model, self.role, direction, transport).inc(nbytes)

    def observe_seconds(self, transport: str, seconds: float) -> None:
        self.seconds.labels(self.model, self.role, transport).observe(seconds)

    def add_failure(self, reason: str) -> None:
        self.failures_total.labels(self.model, self.role, reason).inc()


def create_kv_transfer_metrics(
    registry: CollectorRegistry, model: str, role: str
) -> KVTransferMetrics:
    """Register the three connector metrics on ``registry`` (call once per registry).

    Every known failure reason starts at 0, so a healthy worker already exports the series:
    dashboards and alerts on their rate see 0 rather than no data until the first failure.
    """
    metrics = KVTransferMetrics(
        bytes_total=Counter(
            "tandem_kv_transfer_bytes_total",
            "KV cache bytes moved by the connector",
            ["model", "role", "direction", "transport"],
            registry=registry,
        ),
        seconds=Histogram(
            "tandem_kv_transfer_seconds",
            "Time from start_load to the blocks being usable on decode",
            ["model", "role", "transport"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        ),
        failures_total=Counter(
            "tandem_kv_transfer_failures_total",
            "KV transfers and leases that ended in failure, by reason",
            ["model", "role", "reason"],
            registry=registry,
        ),
        model=model,
        role=role,
    )
    for reason in FailureReason:
        metrics.failures_total.labels(model, role, reason.value)
    return metrics
