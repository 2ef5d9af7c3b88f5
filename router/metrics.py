"""Router metrics (DESIGN.md §9) in a per-app CollectorRegistry; every series carries ``model``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    """Created by ``create_app``; handlers and the flow record into it. Series labelled only by
    model are bound to their child once, so recording skips the label lookup."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests_total", "OpenAI requests by route and HTTP status code",
            ["model", "route", "code"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Arrival to first token sent (includes prefill, KV transfer, first decode step)",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model)  # fmt: skip
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds", "Time between consecutive output tokens",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model)  # fmt: skip
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds", "Arrival to last token of a request",
            ["model"], buckets=_E2E_BUCKETS, registry=r,
        ).labels(model)  # fmt: skip
        self.placements = Counter(
            "tandem_router_placements_total", "Placement decisions by pool, policy and reason",
            ["model", "pool", "policy", "reason"], registry=r,
        )  # fmt: skip
        self.prefill_failures = Counter(
            "tandem_router_prefill_failures_total", "Remote prefill attempts that failed",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.kv_resyncs = Counter(
            "tandem_router_kv_event_resyncs_total", "Prefix-index resyncs after lost events",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.workers = Gauge(
            "tandem_router_workers", "Registered workers by role", ["model", "role"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "tandem_router_prompt_tokens_total", "Prompt tokens of served requests", ["model"],
            registry=r,
        ).labels(model)  # fmt: skip
        self.generation_tokens = Counter(
            "tandem_router_generation_tokens_total", "Output tokens streamed to clients",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip

        self.migrations = Counter(
            "tandem_router_migrations_total",
            "Streams moved to another worker after theirs failed (kv_retry: same KV, before "
            "decode's first token; resume: prompt + delivered tokens re-prefilled)",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "tandem_router_queue_depth", "Requests waiting in the router for an in-flight slot",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.inflight = Gauge(
            "tandem_router_inflight_requests", "Worker sub-requests admitted and not yet ended",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.rejections = Counter(
            "tandem_router_rejections_total",
            "Requests refused by admission control (429), by reason",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.timeouts = Counter(
            "tandem_router_request_timeouts_total", "Requests ended by --request-timeout",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip

    def migration(self, reason: str) -> None:
        self.migrations.labels(self.model, reason).inc()

    def rejection(self, reason: str) -> None:
        self.rejections.labels(self.model, reason).inc()

    def request(self, route: str, code: int) -> None:
        self.requests.labels(self.model, route, str(code)).inc()

    def placement(self, pool: str, policy: str, reason: str) -> None:
        self.placements.labels(self.model, pool, policy, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
