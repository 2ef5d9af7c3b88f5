"""The operator's own Prometheus metrics: pool replicas and autoscaler decisions.

The reconciler and the autoscaler record into one `OperatorMetrics` (created by the handler
registry, one per operator process); `serve` exposes it on /metrics from the operator's event
loop, and the returned runner is cleaned up by the registry's cleanup handler. Labels name the
TandemService as tandem_namespace/tandem_service, because Prometheus reserves `namespace` and
`service` for the scraped target's own.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from tandem.operator.autoscaler import Decision, Reason
from tandem.operator.reconcile import PoolStatus

# The reasons under which a decision moves the replica count. Their changed="true" series start
# at 0 when a pool is first evaluated: Prometheus' increase() cannot count the step of a series
# that first appears at 1, so without this the dashboard would show no scaling for a first scale.
SCALING_REASONS = (
    Reason.CLAMPED_TO_BOUNDS,
    Reason.SCALE_TO_MIN_IDLE,
    Reason.SCALE_UP_LATENCY,
    Reason.SCALE_UP_QUEUE,
    Reason.SCALE_UP_KV_CACHE,
    Reason.SCALE_UP_RUNNING,
    Reason.SCALE_DOWN_SLACK,
    Reason.PLANNER_FLOOR,
)


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.pool_replicas = Gauge(
            "tandem_pool_replicas",
            "Replicas of a TandemService pool (state: desired or ready).",
            ["tandem_namespace", "tandem_service", "pool", "state"],
            registry=self.registry,
        )
        self.desired = Gauge(
            "tandem_autoscaler_desired_replicas",
            "Replica count the autoscaler last decided for a pool.",
            ["tandem_namespace", "tandem_service", "pool"],
            registry=self.registry,
        )
        self.load_ratio = Gauge(
            "tandem_autoscaler_load_ratio",
            "Demand over target that drove the last decision (1.0 = exactly at target).",
            ["tandem_namespace", "tandem_service", "pool"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "tandem_autoscaler_decisions",
            "Autoscaler evaluations by outcome (changed: whether the count moved).",
            ["tandem_namespace", "tandem_service", "pool", "reason", "changed"],
            registry=self.registry,
        )
        self.reconciles = Counter(
            "tandem_operator_reconciles",
            "Reconcile passes by result (ok, degraded, error).",
            ["result"],
            registry=self.registry,
        )

    def record_pools(self, namespace: str, name: str, pools: dict[str, PoolStatus | None]) -> None:
        for pool, status in pools.items():
            desired = 0 if status is None else status.replicas
            ready = 0 if status is None else status.ready
            self.pool_replicas.labels(namespace, name, pool, "desired").set(desired)
            self.pool_replicas.labels(namespace, name, pool, "ready").set(ready)

    def record_decision(self, namespace: str, name: str, decision: Decision) -> None:
        pool = decision.pool.label
        self.desired.labels(namespace, name, pool).set(decision.desired)
        if decision.ratio is not None:
            self.load_ratio.labels(namespace, name, pool).set(decision.ratio)
        for reason in SCALING_REASONS:
            self.decisions.labels(namespace, name, pool, reason.camel, "true")
        changed = "true" if decision.changed else "false"
        self.decisions.labels(namespace, name, pool, decision.reason.camel, changed).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted TandemService's series."""
        for metric in (self.pool_replicas, self.desired, self.load_ratio, self.decisions):
            for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no API
                if labels[:2] == (namespace, name):
                    metric.remove(*labels)

    async def serve(self, host: str, port: int) -> web.AppRunner:
        async def metrics(_: web.Request) -> web.Response:
            body = generate_latest(self.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner
