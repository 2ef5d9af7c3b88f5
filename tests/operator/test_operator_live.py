"""Live end to end: the operator's autoscaler and the Grafana dashboard against a real Prometheus
scraping a real `tandem up` (the rendered pod commands serving: test_operator_pod_commands.py).

One module-scoped stack serves the Prometheus tests: `tandem up` (1 prefill + 1 decode, KV over
TCP), kmock's Kubernetes emulator with the real operator (`tandem operator`), and the Debian
`prometheus` binary scraping the router, both workers and the operator's own /metrics, with the
labels a PodMonitor would add in a cluster. The emulator has no kubelet: the test posts Pod
objects standing for the `tandem up` processes (same names as Prometheus' `pod` label) and plays
the Deployment controller's readiness, as test_operator_e2e.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from chat_load import ChatLoad
from dashboard import dashboard_exprs, to_promql
from kube_emulator import EmulatorThread
from local_process import LocalProcess, tandem_argv
from procs import AUTH, Proc, free_port, poll, wait_for
from prom_server import PrometheusServer, ScrapeTarget, prometheus_binary

from tandem.operator.autoscaler import Decision, Pool, PoolMemory, PoolState, Reason, decide
from tandem.operator.scaling import policies
from tandem.operator.signals import PodInfo, PrometheusSource
from tandem.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
NS = "default"
NAME = "live"
TSVC = f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/tandemservices"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
EVENTS = f"/api/v1/namespaces/{NS}/events"
TINY_TTFT = 0.001
TINY_ITL = 0.0001  # well under one decode step, and still printed as a plain decimal
WINDOW = 10  # the smallest windowSeconds the CRD allows

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None, reason="the prometheus binary is not installed (apt: prometheus)"
)


# --- the live stack: tandem up + emulator and operator + prometheus ----------------------------


class LiveStack:
    """Everything the Prometheus tests share; `close` stops all of it, whatever started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.up_port = free_port()
        self.up_url = f"http://127.0.0.1:{self.up_port}"
        self.up_internal = free_port()
        self.operator_port = free_port()
        self.up: Proc | None = None
        self.operator: LocalProcess | None = None
        self.prometheus: PrometheusServer | None = None
        self.emulator = EmulatorThread()
        self.kube = httpx.Client(timeout=10)
        # Undoes whatever started, last first, even if a later step failed.
        self.cleanup = contextlib.ExitStack()
        self.cleanup.callback(self.kube.close)

    def start(self, binary: str) -> None:
        # Slowest first, so the model loads while the rest starts.
        up_dir = self.tmp / "up"
        up_dir.mkdir()
        self.up = Proc(
            [
                "up",
                "--port",
                str(self.up_port),
                "--internal-port",
                str(self.up_internal),
                "--prefill",
                "1",
                "--decode",
                "1",
                "--kv-transport",
                "tcp",
                "--log-dir",
                str(up_dir),
            ],
            up_dir,
            "up",
        )
        self.cleanup.callback(self.up.stop, signal.SIGINT)
        self.cleanup.callback(self.emulator.stop)
        self.emulator.start()
        self.kube.base_url = httpx.URL(self.emulator.url)
        kubeconfig = self.tmp / "kubeconfig"
        kubeconfig.write_text(self.emulator.kubeconfig(NS))
        crd = yaml.safe_load((REPO / "manifests/crd/tandemservices.tandem.dev.yaml").read_text())
        self.kube.post(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd
        ).raise_for_status()
        self.operator = LocalProcess(
            tandem_argv(
                [
                    "operator",
                    "--all-namespaces",
                    "--standalone",
                    "--resync-seconds",
                    "1",
                    "--metrics-host",
                    "127.0.0.1",
                    "--metrics-port",
                    str(self.operator_port),
                ]
            ),
            self.tmp,
            "operator",
            {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(self.tmp)},
        )
        self.cleanup.callback(self.operator.stop)
        self.operator.wait_http_ok(f"http://127.0.0.1:{self.operator_port}/metrics", 60)
        workers = poll("tandem up: router + 1 prefill + 1 decode", self._two_workers, 180)
        targets = [self._pod_target("router", f"127.0.0.1:{self.up_port}")]
        targets += [self._pod_target(w["role"], w["url"].removeprefix("http://")) for w in workers]
        # The operator's series carry tandem_namespace/tandem_service themselves.
        targets.append(ScrapeTarget("tandem-operator", f"127.0.0.1:{self.operator_port}"))
        prom_dir = self.tmp / "prometheus"
        prom_dir.mkdir()
        self.prometheus = PrometheusServer(binary, prom_dir, targets)
        self.cleanup.callback(self.prometheus.stop)
        self.prometheus.wait_targets_up(60)

    @staticmethod
    def _pod_target(pool: str, address: str) -> ScrapeTarget:
        labels = {"namespace": NS, "pod": f"{NAME}-{pool}-0", "tandem_service": NAME, "pool": pool}
        return ScrapeTarget("tandem-pods", address, labels)

    def _two_workers(self) -> list[dict[str, Any]] | None:
        assert self.up is not None
        if not self.up.alive():
            raise RuntimeError(f"tandem up exited:\n{self.up.log_tail()}")
        try:
            r = httpx.get(
                f"http://127.0.0.1:{self.up_internal}/internal/workers", headers=AUTH, timeout=2
            )
            workers = r.json()["workers"]
        except (httpx.HTTPError, ValueError):
            return None
        return workers if sorted(w["role"] for w in workers) == ["decode", "prefill"] else None

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.kube.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def merge_patch(self, path: str, body: dict[str, Any]) -> None:
        self.kube.patch(
            path,
            content=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()

    def replicas(self, pool: str) -> int | None:
        d = self.get(f"{DEPLOY}/{NAME}-{pool}")
        return None if d is None else d["spec"]["replicas"]

    def operator_log(self) -> str:
        return "" if self.operator is None else self.operator.log_tail(60)

    def close(self) -> None:
        self.cleanup.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("the prometheus binary is not installed (apt: prometheus)")
    live = LiveStack(tmp_path_factory.mktemp("live"))
    try:
        live.start(binary)
        yield live
    finally:
        live.close()


def autoscaling(ttft: float, itl: float, prometheus_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "prefill": {"minReplicas": 1, "maxReplicas": 3},
        "decode": {"minReplicas": 1, "maxReplicas": 3},
        "ttftSeconds": ttft,
        "itlSeconds": itl,
        "intervalSeconds": 5,
        "warmupSeconds": 0,
        "metrics": {
            "source": "prometheus",
            "prometheusUrl": prometheus_url,
            "windowSeconds": WINDOW,
        },
        **extra,
    }


def pod_object(pool: str) -> dict[str, Any]:
    """The Pod a Deployment would have made, standing for the `tandem up` process of `pool`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{NAME}-{pool}-0",
            "namespace": NS,
            "labels": {"tandem.dev/service": NAME, "tandem.dev/pool": pool},
        },
        "spec": {"containers": [{"name": pool, "image": "local"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}
            ],
        },
    }


def scaled_events(live: LiveStack) -> dict[str, str]:
    """pool -> message of its first ScaledPool event for the live TandemService."""
    out: dict[str, str] = {}
    for e in (live.get(EVENTS) or {"items": []})["items"]:
        if e.get("reason") == "ScaledPool" and e["involvedObject"]["name"] == NAME:
            pool = e["message"].split(":", 1)[0]
            out.setdefault(pool, e["message"])
    return out


class Autoscaled:
    """What the operator did while the live stack was under load."""

    def __init__(self, events: dict[str, str], status: dict[str, Any], load_right: int) -> None:
        self.events = events
        self.status = status
        self.load_right = load_right


@pytest.fixture(scope="module")
def autoscaled(stack: LiveStack) -> Autoscaled:
    """The real operator, reading the real Prometheus with SLO targets the load breaches,
    scales both pools of the live TandemService from 1 to its max of 3."""
    assert stack.prometheus is not None
    for pool in ("router", "prefill", "decode"):
        stack.kube.post(PODS, json=pod_object(pool)).raise_for_status()
    spec = {
        "model": {"name": "demo"},
        "kvTransfer": {"transport": "tcp"},
        "autoscaling": autoscaling(TINY_TTFT, TINY_ITL, stack.prometheus.url),
    }
    body = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": spec,
    }
    stack.kube.post(TSVC, json=body).raise_for_status()
    for pool in ("router", "prefill", "decode"):
        d = poll(f"Deployment {pool}", lambda p=pool: stack.get(f"{DEPLOY}/{NAME}-{p}"), 60)
        ready = {
            "observedGeneration": d["metadata"]["generation"],
            "replicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
            "updatedReplicas": 1,
        }
        stack.merge_patch(f"{DEPLOY}/{NAME}-{pool}/status", {"status": ready})
    with ChatLoad(stack.up_url, concurrency=2) as load:
        try:
            poll(
                "the operator to scale prefill and decode to 3",
                lambda: stack.replicas("prefill") == 3 and stack.replicas("decode") == 3,
                90,
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{stack.operator_log()}") from exc
        tally = load.snapshot()
    status = (stack.get(f"{TSVC}/{NAME}") or {})["status"]
    events = poll(
        "ScaledPool events", lambda: (e := scaled_events(stack)) and len(e) == 2 and e, 30
    )
    assert tally.wrong == 0 and tally.failed == 0, tally
    return Autoscaled(events, status, tally.right)


# --- autoscaler ---------------------------------------------------------------------------------


def collect(source: PrometheusSource) -> dict[Pool, Any]:
    pods = [
        PodInfo(f"{NAME}-{p}-0", p, "127.0.0.1", 0, True, 3600.0) for p in ("prefill", "decode")
    ]

    async def run() -> dict[Pool, Any]:
        async with aiohttp.ClientSession() as session:
            return await source.collect(session, pods, time.time())

    return asyncio.run(run())


@needs_prometheus
def test_prometheus_source_reads_live_load_and_decides(stack: LiveStack) -> None:
    """The operator's Prometheus source and pure decision, in process, on live numbers:
    breached targets scale both pools up, generous ones hold at min."""
    assert stack.prometheus is not None
    tight = parse_spec({"autoscaling": autoscaling(TINY_TTFT, TINY_ITL, stack.prometheus.url)})
    generous = parse_spec({"autoscaling": autoscaling(30.0, 5.0, stack.prometheus.url)})
    m = tight.autoscaling.metrics
    # As the operator's timer builds it (Controller._source).
    source = PrometheusSource(
        m.prometheus_url,
        m.selector.format(namespace=NS, name=NAME),
        m.window_seconds,
        tight.autoscaling.warmup_seconds,
    )

    def measured() -> dict[Pool, Any] | None:
        signals = collect(source)
        complete = all(
            s is not None and s.latency_p90 is not None and s.throughput > 0
            for s in signals.values()
        )
        return signals if complete else None

    with ChatLoad(stack.up_url, concurrency=2) as load:
        signals = poll("latency and throughput in prometheus", measured, 60, interval=1.0)
    assert load.tally.wrong == 0 and load.tally.failed == 0, load.tally
    for pool, s in signals.items():
        assert 0 < s.latency_p90 < 30, (pool, s)
        assert s.arrivals > 0 and s.throughput > 0, (pool, s)
        assert s.kv_usage is not None and 0 <= s.kv_usage <= 1, (pool, s)
        assert s.warm_replicas == 1
    now = time.time()
    up: dict[Pool, Decision] = {}
    for pool, target in ((Pool.PREFILL, TINY_TTFT), (Pool.DECODE, TINY_ITL)):
        pol = policies(tight)[pool]
        up[pool] = decide(pool, PoolState(1, 1), signals[pool], PoolMemory(), pol, now)
        assert (up[pool].desired, up[pool].reason) == (3, Reason.SCALE_UP_LATENCY), up[pool]
        assert up[pool].ratio == pytest.approx(signals[pool].latency_p90 / target)
        held = decide(
            pool, PoolState(1, 1), signals[pool], PoolMemory(), policies(generous)[pool], now
        )
        assert (held.desired, held.reason) == (1, Reason.AT_MIN), held
    # Load over: once the window holds no traffic, both pools read idle and go to min.
    idle = poll(
        "prometheus to read the pools idle",
        lambda: (s := collect(source)) and all(v is not None and v.idle for v in s.values()) and s,
        WINDOW + 30,
        interval=1.0,
    )
    for pool in (Pool.PREFILL, Pool.DECODE):
        pol = policies(generous)[pool]
        slack = PoolMemory(slack_since=now - pol.scale_down_cooldown - 1)
        down = decide(pool, PoolState(3, 3), idle[pool], slack, pol, time.time())
        assert (down.desired, down.reason) == (1, Reason.SCALE_TO_MIN_IDLE), down
        at_min = decide(pool, PoolState(1, 1), idle[pool], PoolMemory(), pol, time.time())
        assert (at_min.desired, at_min.reason) == (1, Reason.IDLE_AT_MIN), at_min


SCALED = re.compile(
    r"^(prefill|decode): 1 -> 3 \(ScaleUpLatency\); load ratio ([\d.]+) from latency; "
    r"p90 ([\d.]+)s vs target ([\d.]+)s$"
)


@needs_prometheus
def test_operator_scales_up_under_load_and_back_to_min(
    stack: LiveStack, autoscaled: Autoscaled
) -> None:
    """The real operator's timer, reading the real Prometheus: scale up on breached latency
    under load, then (generous targets, no load) scale to min and hold there."""
    assert autoscaled.load_right > 0
    for pool, target in (("prefill", TINY_TTFT), ("decode", TINY_ITL)):
        m = SCALED.match(autoscaled.events[pool])
        assert m is not None, autoscaled.events[pool]
        ratio, p90 = float(m.group(2)), float(m.group(3))
        assert float(m.group(4)) == target
        assert 0 < p90 < 30
        # The message rounds p90 to 4 decimals and the ratio to 2.
        assert abs(ratio - p90 / target) <= 0.00005 / target + 0.005, autoscaled.events[pool]
    last = autoscaled.status["autoscaling"]["lastDecision"]
    assert (last["from"], last["to"], last["reason"]) == (1, 3, "ScaleUpLatency")
    metrics = last["metrics"]
    assert metrics["latencyP90Seconds"] > 0
    assert metrics["arrivalsPerSecond"] > 0 and metrics["tokensPerSecond"] > 0
    assert metrics["warmReplicas"] == 1
    assert last["loadRatio"] == pytest.approx(
        metrics["latencyP90Seconds"] / last["latencyTargetSeconds"], rel=1e-3
    )

    assert stack.prometheus is not None
    relaxed = autoscaling(30.0, 5.0, stack.prometheus.url, scaleDownCooldownSeconds=0)
    stack.merge_patch(f"{TSVC}/{NAME}", {"spec": {"autoscaling": relaxed}})
    try:
        poll(
            "the operator to scale both pools back to 1",
            lambda: stack.replicas("prefill") == 1 and stack.replicas("decode") == 1,
            WINDOW + 40,
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n--- operator log ---\n{stack.operator_log()}") from exc
    down = (stack.get(f"{TSVC}/{NAME}") or {})["status"]["autoscaling"]["lastDecision"]
    assert (down["from"], down["to"], down["reason"]) == (3, 1, "ScaleToMinIdle")
    assert down["metrics"]["arrivalsPerSecond"] == 0 and down["metrics"]["tokensPerSecond"] == 0

    def holding() -> bool:
        status = (stack.get(f"{TSVC}/{NAME}") or {})["status"]["autoscaling"]
        return all(
            status[p]["lastEvaluation"]["reason"] == "IdleAtMin" for p in ("prefill", "decode")
        )

    poll("both pools holding at min", holding, 20)
    assert stack.replicas("prefill") == 1 and stack.replicas("decode") == 1


# --- dashboard ----------------------------------------------------------------------------------


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for r in result if math.isfinite(v := float(r["value"][1]))]


@needs_prometheus
def test_dashboard_queries_return_data(stack: LiveStack, autoscaled: Autoscaled) -> None:
    """Every PromQL expression of the Grafana dashboard parses and returns at least one finite
    value from the real Prometheus scraping the live service and the operator."""
    assert stack.prometheus is not None
    prom = stack.prometheus
    queries = [(title, to_promql(expr, NS, NAME)) for title, expr in dashboard_exprs()]
    assert len(queries) >= 20
    # Parsing is checked on its own: an error here is the expression's, not missing data.
    for _, promql in queries:
        prom.query(promql)
    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = [f"{t}: {q}" for t, q in queries if not finite_values(prom.query(q))]
        return not missing

    # Fresh traffic, so every rate over the dashboard's 1m window has something to show.
    with ChatLoad(stack.up_url, concurrency=2, max_per_thread=15) as load:
        try:
            wait_for(all_have_data, 45, "every dashboard query to return data", interval=1.0)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; still empty:\n" + "\n".join(missing)) from exc
    assert load.tally.wrong == 0 and load.tally.failed == 0, load.tally
    # The scale-ups the operator made are counted, not just present as series.
    (decisions,) = [q for t, q in queries if t == "Autoscaler decisions"]
    counted = {(r["metric"]["pool"], r["metric"]["reason"]): r for r in prom.query(decisions)}
    for pool in ("prefill", "decode"):
        assert float(counted[(pool, "ScaleUpLatency")]["value"][1]) >= 0.99, counted
