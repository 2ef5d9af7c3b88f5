"""Kopf handlers for TandemService: thin wiring from Kopf's events to the reconciler.

`build_registry(config)` is called once by the CLI; the registry's startup handler creates the
Kubernetes client and the HTTP session for metrics (kept in the registry's closure, together
with the per-object locks), and the cleanup handler closes them.

Every path (create, update, resume, the resync timer, events of children) ends in
`Controller.reconcile`, which re-reads the TandemService, so a stale event body cannot roll
back a newer autoscaling decision. One lock per object serializes the passes.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from tandem.operator import cluster_secret
from tandem.operator.autoscaler import Decision, Pool, PoolState, decide
from tandem.operator.children import Replicas, render_children
from tandem.operator.cluster_secret import (
    ClusterTokenProblem,
    delete_cluster_token,
    ensure_cluster_token,
)
from tandem.operator.kube import KubeAPIError, KubeClient, object_path
from tandem.operator.naming import (
    GROUP,
    KIND,
    MANAGED_BY,
    PLURAL,
    VERSION,
    Owner,
    cluster_token_metadata,
    router_url,
)
from tandem.operator.opmetrics import OperatorMetrics
from tandem.operator.planner_client import PlannerClient
from tandem.operator.planner_steps import (
    planned_decisions,
    planned_start,
    planner_event,
    start_replicas,
)
from tandem.operator.reconcile import (
    Action,
    ChildConflictError,
    apply_children,
    delete_children,
    drifted,
    is_subset,
    list_pods,
    pools_from,
    read_pools,
)
from tandem.operator.scaling import (
    autoscaling_status,
    effective_replicas,
    memory_from_status,
    policies,
)
from tandem.operator.signals import DirectSource, PrometheusSource, SignalSource
from tandem.operator.spec import MetricsSource, SpecError, TandemServiceSpec, parse_spec
from tandem.operator.status import (
    DegradedReason,
    Problem,
    build_status,
    with_metrics_condition,
)

FINALIZER = "tandem.dev/finalizer"

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Operator-wide settings from the command line."""

    resync_seconds: float = 10.0
    scrape_timeout_seconds: float = 3.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None: no /metrics endpoint
    plan_timeout_seconds: float = 120.0  # one `tandem plan` subprocess (planner.py)


def _now_text() -> str:
    now = datetime.datetime.now(tz=datetime.UTC)
    return now.isoformat(timespec="seconds").replace("+00:00", "Z")


def _login() -> kopf.ConnectionInfo:
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig to log in with")
    return info


class ObjectState:
    """Per-TandemService state, kept by the registry while the object exists: the lock that
    serializes passes, the metrics source (with its previous scrapes) and autoscaler pacing."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.source: SignalSource | None = None
        self.source_key: tuple[Any, ...] | None = None
        self.last_autoscale: float | None = None
        self.last_reasons: dict[Pool, str] = {}
        self.last_metrics_error: str | None = None
        # A pass is queued on the lock: later triggers can rely on it (it re-reads everything).
        self.queued = False


class Controller:
    """Reconciles TandemServices. The startup handler creates it with the client, session and
    metrics it then owns; the cleanup handler sets `closing` and closes them."""

    def __init__(
        self,
        client: KubeClient,
        http: aiohttp.ClientSession,
        cfg: OperatorConfig,
        metrics: OperatorMetrics,
        planner: PlannerClient | None = None,
    ) -> None:
        self.client = client
        self.http = http
        self.cfg = cfg
        self.metrics = metrics
        self.planner = planner or PlannerClient(timeout_seconds=cfg.plan_timeout_seconds)
        # Set at operator shutdown: passes still in flight stop quietly instead of failing
        # (a failure would be stored as a delayed retry on the object).
        self.closing = False

    async def fetch(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.client.get(object_path(f"{GROUP}/{VERSION}", KIND, namespace, name))

    async def patch_status(self, body: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        path = object_path(f"{GROUP}/{VERSION}", KIND, meta["namespace"], meta["name"], "status")
        await self.client.merge_patch(path, {"status": dict(patch)})

    async def reconcile(
        self, namespace: str, name: str, state: ObjectState, autoscale: bool = False
    ) -> None:
        try:
            await self._reconcile(namespace, name, state, autoscale)
        except Exception:
            if self.closing:
                return
            self.metrics.reconciles.labels("error").inc()
            raise

    async def _reconcile(
        self, namespace: str, name: str, state: ObjectState, autoscale: bool
    ) -> None:
        if self.closing or (state.queued and not autoscale):
            return
        state.queued = True
        try:
            await state.lock.acquire()
        finally:
            state.queued = False
        try:
            body = await self.fetch(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            spec = await self._apply(body)
            if autoscale and spec is not None and spec.autoscaling.enabled:
                await self._autoscale(body, spec, state)
        finally:
            state.lock.release()

    async def _apply(self, body: dict[str, Any]) -> TandemServiceSpec | None:
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        status = body.get("status") or {}
        problem: Problem | None = None
        spec: TandemServiceSpec | None = None
        applied: dict[str, tuple[Action, dict[str, Any]]] = {}
        try:
            spec = parse_spec(body.get("spec") or {})
        except SpecError as exc:
            problem = Problem(DegradedReason.INVALID_SPEC, str(exc))
        if spec is not None and spec.autoscaling.planner and not planned_start(status):
            step = await start_replicas(
                self.planner, self.client, owner.namespace, owner.name, spec
            )
            planner_event(body, status, step, "PlannedReplicas")
            await self.patch_status(body, {"autoscaling": {"planner": step.status}})
            status = {**status, "autoscaling": {**(status.get("autoscaling") or {}),
                                                "planner": step.status}}  # fmt: skip
        if spec is not None:
            try:
                if await ensure_cluster_token(
                    self.client, cluster_token_metadata(owner), owner.uid
                ):
                    secret = cluster_secret.secret_name(owner.name)
                    kopf.event(body, type="Normal", reason="ChildCreated",
                               message=f"Secret/{secret}")  # fmt: skip
            except ClusterTokenProblem as exc:
                problem = Problem(DegradedReason.CLUSTER_TOKEN, str(exc))
        if spec is not None and problem is None:
            children = render_children(owner, spec, effective_replicas(spec, status))
            try:
                applied = await apply_children(self.client, owner, children)
            except ChildConflictError as exc:
                problem = Problem(DegradedReason.CHILD_CONFLICT, str(exc))
            except KubeAPIError as exc:
                if exc.status not in (400, 403, 422):
                    raise
                problem = Problem(DegradedReason.APPLY_FAILED, str(exc))
        for key, (action, _) in applied.items():
            if action is not Action.UNCHANGED:
                kopf.event(
                    body, type="Normal", reason=f"Child{action.name.capitalize()}", message=key
                )
        previous = {c.get("type"): c for c in status.get("conditions") or []}
        if problem is not None and previous.get("Degraded", {}).get("message") != problem.message:
            kopf.event(body, type="Warning", reason=problem.reason.camel, message=problem.message)
            # Once per new problem, as the Event: the passes that follow succeed quietly, so
            # without this line the operator's log never says why no children appear.
            log.warning("%s/%s degraded (%s): %s", owner.namespace, owner.name,
                        problem.reason.camel, problem.message)  # fmt: skip
        pools = pools_from(owner, applied) if applied else await read_pools(self.client, owner)
        self.metrics.record_pools(owner.namespace, owner.name, pools)
        self.metrics.reconciles.labels("ok" if problem is None else "degraded").inc()
        endpoint = router_url(owner, spec) if spec is not None else status.get("endpoint")
        new = build_status(
            meta.get("generation"),
            pools,
            endpoint,
            problem,
            status.get("conditions") or [],
            _now_text(),
        )
        if spec is not None and not spec.autoscaling.enabled and "autoscaling" in status:
            new["autoscaling"] = None  # stale decisions would mislead once scaling is off
        if not is_subset(new, status):
            await self.patch_status(body, new)
        return spec if problem is None else None

    async def _report_metrics_source(
        self, body: dict[str, Any], source: SignalSource, state: ObjectState
    ) -> None:
        """MetricsAvailable and an Event when the metrics source starts or stops answering:
        a failing or hostile Prometheus degrades this TandemService's autoscaling only."""
        error = getattr(source, "last_error", None)
        meta = body["metadata"]
        # Re-read: this pass's apply may have changed the other conditions since ``body``.
        fresh = await self.fetch(meta["namespace"], meta["name"]) or body
        conditions = (fresh.get("status") or {}).get("conditions") or []
        new = with_metrics_condition(conditions, error, _now_text())
        if not is_subset(new, conditions) or len(new) != len(conditions):
            await self.patch_status(body, {"conditions": new})
        if error != state.last_metrics_error:
            if error is not None:
                kopf.event(body, type="Warning", reason="MetricsUnavailable", message=error)
            elif state.last_metrics_error is not None:
                kopf.event(body, type="Normal", reason="MetricsAvailable",
                           message="the metrics source answers again")  # fmt: skip
            state.last_metrics_error = error

    def _source(self, spec: TandemServiceSpec, state: ObjectState, body: Mapping) -> SignalSource:
        a = spec.autoscaling
        key = (a.metrics, a.warmup_seconds)
        if state.source is None or state.source_key != key:
            meta = body["metadata"]
            if a.metrics.source is MetricsSource.PROMETHEUS:
                selector = a.metrics.selector.format(namespace=meta["namespace"], name=meta["name"])
                state.source = PrometheusSource(
                    a.metrics.prometheus_url, selector, a.metrics.window_seconds, a.warmup_seconds
                )
            else:
                state.source = DirectSource(a.warmup_seconds, self.cfg.scrape_timeout_seconds)
            state.source_key = key
        return state.source

    async def _autoscale(
        self, body: dict[str, Any], spec: TandemServiceSpec, state: ObjectState
    ) -> None:
        now = time.time()
        interval = spec.autoscaling.interval_seconds
        if state.last_autoscale is not None and now - state.last_autoscale < interval - 0.5:
            return
        state.last_autoscale = now
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        status = body.get("status") or {}
        source = self._source(spec, state, body)
        moment = datetime.datetime.fromtimestamp(now, tz=datetime.UTC)
        pods = await list_pods(self.client, owner, spec, moment)
        signals = await source.collect(self.http, pods, now)
        await self._report_metrics_source(body, source, state)
        pools = await read_pools(self.client, owner)
        pols = policies(spec)
        decisions: dict[Pool, Decision] = {}
        for pool in (Pool.PREFILL, Pool.DECODE):
            live = pools.get(pool.label)
            if live is None:
                continue
            decisions[pool] = decide(
                pool,
                PoolState(current=live.replicas, ready=live.ready),
                signals.get(pool),
                memory_from_status(status, pool),
                pols[pool],
                now,
            )
        if not decisions:
            return
        planner_status = None
        if spec.autoscaling.planner:
            running = Replicas(
                prefill=pools["prefill"].replicas if pools.get("prefill") else 0,
                decode=pools["decode"].replicas if pools.get("decode") else 0,
            )
            decisions, step = await planned_decisions(
                self.planner, self.client, owner.namespace, owner.name, spec, signals,
                decisions, pols, running, status, now,
            )  # fmt: skip
            planner_event(body, status, step, None)
            planner_status = step.status
        patch = {"autoscaling": autoscaling_status(decisions, pols, status, now)}
        if planner_status is not None:
            patch["autoscaling"]["planner"] = planner_status
        await self.patch_status(body, patch)
        for pool, decision in decisions.items():
            self.metrics.record_decision(owner.namespace, owner.name, decision)
            reason = decision.reason.camel
            if decision.changed or state.last_reasons.get(pool) != reason:
                kind = "ScaledPool" if decision.changed else "AutoscalerHolding"
                kopf.event(body, type="Normal", reason=kind, message=decision.message(pols[pool]))
            state.last_reasons[pool] = reason
        if any(d.changed for d in decisions.values()):
            current = effective_replicas(spec, status)
            replicas = Replicas(
                prefill=decisions[Pool.PREFILL].desired
                if Pool.PREFILL in decisions
                else current.prefill,
                decode=decisions[Pool.DECODE].desired
                if Pool.DECODE in decisions
                else current.decode,
            )
            await apply_children(self.client, owner, render_children(owner, spec, replicas))


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    """All of the operator's handlers, registered on a fresh registry (no module globals)."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)
    owned_labels = {"app.kubernetes.io/managed-by": MANAGED_BY}
    shared: dict[str, Any] = {}
    metrics = OperatorMetrics()
    states: dict[tuple[str, str], ObjectState] = {}

    def object_state(namespace: str, name: str) -> ObjectState:
        return states.setdefault((namespace, name), ObjectState())

    @kopf.on.login(id="login", registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return _login()

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        # Only warnings logged by Kopf become Events; ours are posted explicitly (kopf.event).
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        # Deletion waits for a running resync pass to end; re-check every 2 s, not Kopf's 60.
        settings.background.cancellation_polling = 2
        client = KubeClient(_login)
        http = aiohttp.ClientSession()
        shared["controller"] = Controller(client, http, cfg, metrics)
        if cfg.metrics_port is not None:
            shared["metrics_runner"] = await metrics.serve(cfg.metrics_host, cfg.metrics_port)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(**_: Any) -> None:
        controller = shared.pop("controller", None)
        if controller is not None:
            controller.closing = True
            await controller.client.close()
            await controller.http.close()
            controller.planner.close()
        runner = shared.pop("metrics_runner", None)
        if runner is not None:
            await runner.cleanup()

    # Failures are API errors worth retrying soon, not Kopf's default minute later.
    # Explicit ids: Kopf stores progress in annotations named after them.
    @kopf.on.resume(*resource, id="apply", backoff=5, registry=registry)
    @kopf.on.create(*resource, id="apply", backoff=5, registry=registry)
    @kopf.on.update(*resource, id="apply", backoff=5, registry=registry)
    async def apply(name: str, namespace: str, **_: Any) -> None:
        controller = shared.get("controller")
        if controller is not None:
            await controller.reconcile(namespace, name, object_state(namespace, name))

    @kopf.timer(*resource, id="resync", interval=cfg.resync_seconds, backoff=5, registry=registry)
    async def resync(name: str, namespace: str, **_: Any) -> None:
        controller = shared.get("controller")
        if controller is not None:
            await controller.reconcile(namespace, name, object_state(namespace, name), True)

    @kopf.on.delete(*resource, id="delete", backoff=5, registry=registry)
    async def delete(name: str, namespace: str, uid: str, body: kopf.Body, **_: Any) -> None:
        controller = shared["controller"]
        state = states.pop((namespace, name), None) or ObjectState()
        async with state.lock:
            deleted = await delete_children(controller.client, Owner(name, namespace, uid))
            if await delete_cluster_token(controller.client, namespace, name, uid):
                deleted.append(f"Secret/{cluster_secret.secret_name(name)}")
        metrics.forget(namespace, name)
        if deleted:
            kopf.event(body, type="Normal", reason="ChildrenDeleted", message=", ".join(deleted))

    async def child_changed(body: kopf.Body, namespace: str, type: str | None, **_: Any) -> None:
        controller = shared.get("controller")
        if controller is None or type is None:
            return  # the initial listing: resume handlers reconcile every owner anyway
        # Our own writes come back as events too: only a deleted or drifted child, or a
        # Deployment (whose status feeds ours), needs a pass.
        if type != "DELETED" and body.get("kind") != "Deployment" and not drifted(body):
            return
        for ref in body.get("metadata", {}).get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
                await controller.reconcile(
                    namespace, ref["name"], object_state(namespace, ref["name"])
                )

    for group, version, plural in (
        ("apps", "v1", "deployments"),
        ("", "v1", "services"),
        ("", "v1", "configmaps"),
    ):
        kopf.on.event(
            group=group,
            version=version,
            plural=plural,
            id=f"child-{plural}",
            labels=owned_labels,
            registry=registry,
        )(child_changed)
    return registry
