"""The router's configuration and per-app state: registry, prefix index, clients, flow context.

``RouterState`` is built by the app's lifespan (``app.py``) and reached by handlers through
``app.state.router``; it keeps the registry, prefix index and KV-event subscriptions in step.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from fastapi import Request

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.model_path import resolve_model_path
from tandem.engine.request_limits import MAX_REQUEST_BYTES
from tandem.engine.role import Role
from tandem.router.admission import Admission, capacity_limit
from tandem.router.errors import OpenAIError
from tandem.router.flow import FlowConfig, FlowContext
from tandem.router.gate import AdmissionGate
from tandem.router.kv_events import KvEventSubscriber
from tandem.router.metrics import RouterMetrics
from tandem.router.placement import Placer, Policy
from tandem.router.prefix_index import ApplyResult, PrefixIndex
from tandem.router.registry import (
    WorkerInfo,
    WorkerRegistry,
    WorkerState,
    check_against_router,
)
from tandem.router.tokenizer import PromptEncoder
from tandem.router.worker_client import Timeouts, WorkerClient

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 256  # the engine's default batch size, for workers that do not say


@dataclass(slots=True, frozen=True)
class RouterConfig:
    model: str = "demo"  # served name, exactly as given to --model; workers must report the same
    model_path: str | None = None  # tokenizer directory; None resolves ``model``
    policy: Policy = Policy.PREFIX_AWARE
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0
    peer_pull_min_tokens: int = 0  # --peer-pull-min-tokens (router/peer_pull.py); 0: off
    api_keys: tuple[str, ...] = ()
    heartbeat_timeout_s: float = 3.0
    expiry_interval_s: float = 0.5
    events_stale_after_s: float = 5.0
    max_body_bytes: int = MAX_REQUEST_BYTES  # --max-request-bytes
    timeouts: Timeouts = field(default_factory=Timeouts)
    poll_s: float = 0.25
    # Worker-facing credential (internal listener, worker calls, KV events); None only for
    # in-process apps (tests): ``tandem router`` refuses to start without one.
    cluster_token: ClusterToken | None = None
    # The prefix index holds at most this many block hashes per worker, whatever it claims.
    index_blocks_per_worker: int = 1 << 18
    template_timeout_s: float = 5.0  # rendering one chat template, off the event loop
    # Admission (admission.py): worker sub-requests in flight at once (None: derived from the
    # decode pool's batch sizes), requests waiting here for a slot, and how long they may wait.
    max_inflight_requests: int | None = None
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    request_timeout_s: float = 600.0  # whole-request deadline (0: none)
    migration_limit: int = 1


def model_context_limit(config: RouterConfig) -> int | None:
    """The served model's ``max_position_embeddings`` (registrations may not claim more), when
    the model directory has a readable config.json; None otherwise (a bare tokenizer dir)."""
    try:
        path = Path(config.model_path) if config.model_path else resolve_model_path(config.model)
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if isinstance(value, int) and value > 0 else None


class RouterState:
    """Per-app state built by the lifespan; handlers reach it through ``app.state.router``."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        encoder: PromptEncoder,
        http: aiohttp.ClientSession,
        clock: Callable[[], float],
        max_context: int | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.encoder = encoder
        self.max_context = max_context
        self.registry = WorkerRegistry(clock, config.heartbeat_timeout_s, model=config.model)
        self.index = PrefixIndex(clock, config.events_stale_after_s)
        self.client = WorkerClient(http, config.timeouts, config.cluster_token)
        self.subscriber = KvEventSubscriber(
            self.index, self.client, self._on_event, token=config.cluster_token
        )
        self.flow = FlowContext(
            registry=self.registry,
            index=self.index,
            placer=Placer(config.policy),
            client=self.client,
            metrics=metrics,
            encoder=encoder,
            config=FlowConfig(
                local_prefill_threshold=config.local_prefill_threshold,
                prefill_overload_queue=config.prefill_overload_queue,
                peer_pull_min_tokens=config.peer_pull_min_tokens,
                poll_s=config.poll_s,
                read_timeout_s=config.timeouts.read_s,
                migration_limit=config.migration_limit,
            ),
        )
        self.gate = AdmissionGate(
            Admission(config.max_queued_requests, config.queue_timeout_s),
            self.inflight_limit,
            metrics,
            clock,
        )

    def inflight_limit(self) -> int:
        """Worker sub-requests the router dispatches at once: the configured limit, or twice
        the decode pool's batch slots (``admission.capacity_limit``)."""
        if self.config.max_inflight_requests is not None:
            return self.config.max_inflight_requests
        pool = self.registry.by_role(Role.DECODE, Role.COLOCATED)
        return capacity_limit([w.info.max_num_seqs or DEFAULT_MAX_NUM_SEQS for w in pool])

    def _on_event(self, engine_id: str, result: ApplyResult) -> None:
        if result is ApplyResult.NEEDS_RESYNC:
            self.metrics.kv_resyncs.inc()

    # -- registry ---------------------------------------------------------------------------
    def register(self, info: WorkerInfo) -> None:
        """Validate against what the router knows, then add or refresh; raises OpenAIError
        (400 a bad field, 409 a live id registered differently) with nothing changed."""
        check_against_router(info, HASH_ALGORITHM, self.max_context)
        for old in self.registry.register(info):
            self._forget(old)
        if info.kv_events_endpoint and not self.index.is_synced(info.engine_id):
            capacity = min(info.num_blocks, self.config.index_blocks_per_worker)
            # The router does not learn the host tier's size: its entries get the router's bound.
            self.index.add_worker(info.engine_id, capacity, self.config.index_blocks_per_worker)
            self.subscriber.start(info.engine_id, info.kv_events_endpoint, info.url)
        self._update_gauges()

    def _forget(self, w: WorkerState) -> None:
        self.subscriber.stop(w.info.engine_id)
        self.index.remove_worker(w.info.engine_id)

    def deregister(self, engine_id: str) -> bool:
        w = self.registry.deregister(engine_id)
        if w is not None:
            self._forget(w)
        self._update_gauges()
        return w is not None

    def expire(self) -> None:
        for w in self.registry.expire():
            log.warning("worker %s (%s) stopped heartbeating", w.info.engine_id, w.info.url)
            self._forget(w)
        self._update_gauges()

    def _update_gauges(self) -> None:
        for role in Role:
            n = len(self.registry.by_role(role))
            self.metrics.workers.labels(self.metrics.model, role.label).set(n)

    # -- requests ---------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), k.encode()) for k in self.config.api_keys
        )
        if not ok:
            raise OpenAIError(
                401,
                "Incorrect API key provided." if header else "No API key provided.",
                type="invalid_request_error",
                code="invalid_api_key",
            )
