"""The operator's rendering against reality without a cluster: the rendered pod commands run as
local processes and serve the demo task (P/D over the rendered KV transport), Kubernetes variable
expansion, the Prometheus config, and the metric series the live checks rely on starting at
zero. The Prometheus-backed autoscaler and dashboard checks are in test_operator_live.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from local_process import LocalProcess, tandem_argv
from pod_commands import container_env, expand, local_pod, service_urls
from procs import AUTH, CLUSTER_TOKEN, free_port, poll
from prom_server import ScrapeTarget, prometheus_config
from prometheus_client import CollectorRegistry

from tandem import LLM, SamplingParams
from tandem.engine.demo import expected_answer, held_out_inputs, make_user_message
from tandem.engine.kv_connector import FailureReason
from tandem.kvtransfer.metrics import create_kv_transfer_metrics
from tandem.operator.autoscaler import Decision, Pool, PoolMemory, Reason
from tandem.operator.children import Owner, Replicas, render_children
from tandem.operator.opmetrics import SCALING_REASONS, OperatorMetrics
from tandem.operator.promtext import Snapshot
from tandem.operator.spec import TandemServiceSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
NS = "default"


# --- pure helpers and the metric series the live checks rely on ---------------------------------


def demo_children() -> tuple[TandemServiceSpec, list[dict[str, Any]]]:
    raw = yaml.safe_load((REPO / "manifests/samples/demo-cpu.yaml").read_text())
    spec = parse_spec(raw["spec"])
    owner = Owner(raw["metadata"]["name"], NS, "00000000-0000-4000-8000-000000000001")
    return spec, render_children(owner, spec, Replicas(spec.prefill.replicas, spec.decode.replicas))


def test_local_pod_substitutes_only_what_cannot_work_locally() -> None:
    _, children = demo_children()
    deployments = [c for c in children if c["kind"] == "Deployment"]
    services = [c for c in children if c["kind"] == "Service"]
    config_maps = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    ports = {8000: 18000, 8001: 18001, 8100: 18100, 8101: 18101, 8102: 18102, 8103: 18103,
             8200: 18200, 8201: 18201}  # fmt: skip
    urls = service_urls(services, deployments, ports)
    # Worker Services are headless and selected per pod; their URLs are never used, but map too.
    assert urls["http://demo-router.default.svc:8000"] == "http://127.0.0.1:18000"
    assert urls["http://demo-router-internal.default.svc:8001"] == "http://127.0.0.1:18001"
    mounts = {"/tmp": "/x/prefill", "/etc/tandem/cluster-token": "/x/token"}
    prefill = local_pod(deployments[1], config_maps, ports, urls, mounts)
    assert prefill.argv == tuple(
        tandem_argv(
            [
                "prefill",
                "--model",
                "demo",
                "--host",
                "127.0.0.1",
                "--port",
                "18100",
                "--router-url",
                "http://127.0.0.1:18001",
                "--cluster-token-file",
                "/x/token/token",
                "--kv-transport",
                "tcp",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--kv-events-port",
                "18101",
                "--kv-side-channel-port",
                "18102",
                "--kv-data-port",
                "18103",
                "--engine-option",
                "max_num_batched_tokens=512",
            ]
        )
    )
    assert (prefill.port, prefill.readiness_path) == (18100, "/health")
    assert {k: prefill.env[k] for k in sorted(prefill.env)} == {
        "HF_HUB_OFFLINE": "1",
        "HOME": "/x/prefill",
        "POD_IP": "127.0.0.1",
        "POD_NAME": "demo-prefill-local-0",
        "PYTHONUNBUFFERED": "1",
        "TANDEM_ADVERTISE_HOST": "127.0.0.1",
        "TANDEM_KV_TRANSPORT": "tcp",
        "TANDEM_MODEL": "demo",
        "TANDEM_ROLE": "prefill",
        "TANDEM_ROUTER_URL": "http://127.0.0.1:18000",
        "TANDEM_SERVED_MODEL_NAME": "demo",
        "TRANSFORMERS_OFFLINE": "1",
        "TRITON_CACHE_DIR": "/x/prefill/.triton",
        "UCX_TCP_PORT_RANGE": "8300-8349",
        "XDG_CACHE_HOME": "/x/prefill/.cache",
    }
    with pytest.raises(ValueError, match="envFrom"):
        local_pod(deployments[1], {}, ports, urls, {})


def test_kubernetes_variable_expansion() -> None:
    env = {"A": "x", "B": "$(A)"}
    assert expand("$(A)-$$(A)-$(C)-$(B)", env) == "x-$(A)-$(C)-$(A)"
    container = {
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ADDR", "value": "$(IP):80"},
            {"name": "EARLY", "value": "$(LATE)"},
            {"name": "LATE", "value": "y"},
        ]
    }
    assert container_env(container, {}, "p", "ns") == {
        "IP": "127.0.0.1",
        "ADDR": "127.0.0.1:80",
        "EARLY": "$(LATE)",  # as in Kubernetes: only names defined earlier expand
        "LATE": "y",
    }
    node = {"env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}
    with pytest.raises(ValueError, match="spec.nodeName"):
        container_env(node, {}, "p", "ns")


def test_prometheus_config() -> None:
    targets = [
        ScrapeTarget("pods", "127.0.0.1:1", {"pool": "router"}),
        ScrapeTarget("op", "127.0.0.1:2"),
        ScrapeTarget("pods", "127.0.0.1:3", {"pool": "decode"}),
    ]
    assert prometheus_config(targets) == {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "pods",
                "metrics_path": "/metrics",
                "static_configs": [
                    {"targets": ["127.0.0.1:1"], "labels": {"pool": "router"}},
                    {"targets": ["127.0.0.1:3"], "labels": {"pool": "decode"}},
                ],
            },
            {
                "job_name": "op",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": ["127.0.0.1:2"], "labels": {}}],
            },
        ],
    }


def test_kv_transfer_failure_reasons_start_at_zero() -> None:
    registry = CollectorRegistry()
    create_kv_transfer_metrics(registry, "demo", "decode")
    for reason in FailureReason:
        labels = {"model": "demo", "role": "decode", "reason": reason.value}
        assert registry.get_sample_value("tandem_kv_transfer_failures_total", labels) == 0.0


def test_scaling_decision_series_start_at_zero() -> None:
    metrics = OperatorMetrics()
    hold = Decision(Pool.DECODE, 1, 1, Reason.AT_MIN, 0.2, None, None, PoolMemory())
    metrics.record_decision("ns", "svc", hold)

    def count(reason: Reason, changed: str) -> float | None:
        labels = {
            "tandem_namespace": "ns",
            "tandem_service": "svc",
            "pool": "decode",
            "reason": reason.camel,
            "changed": changed,
        }
        return metrics.registry.get_sample_value("tandem_autoscaler_decisions_total", labels)

    assert count(Reason.AT_MIN, "false") == 1.0
    assert {r: count(r, "true") for r in SCALING_REASONS} == dict.fromkeys(SCALING_REASONS, 0.0)
    assert count(Reason.AT_MIN, "true") is None
    up = Decision(Pool.DECODE, 1, 3, Reason.SCALE_UP_LATENCY, 5.0, None, None, PoolMemory())
    metrics.record_decision("ns", "svc", up)
    assert count(Reason.SCALE_UP_LATENCY, "true") == 1.0


# --- rendered pod commands --------------------------------------------------------------------


def remote_prefills(router: httpx.Client) -> float:
    text = router.get("/metrics").text
    return Snapshot.parse(text).total(
        "tandem_router_placements_total",
        lambda labels: labels.get("pool") == "prefill" and labels.get("reason") == "remote",
    )


def test_rendered_pod_commands_serve(tmp_path: Path) -> None:
    """Each rendered Deployment's container command, run as a local process, serves: the
    workers register with the rendered router, which answers the demo task correctly, and a
    prompt past the local-prefill threshold is prefilled remotely with its KV moved over TCP."""
    spec, children = demo_children()
    deployments = [c for c in children if c["kind"] == "Deployment"]
    services = [c for c in children if c["kind"] == "Service"]
    config_maps = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    assert [d["spec"]["replicas"] for d in deployments] == [1, 1, 1]
    ports = {
        p["containerPort"]: free_port()
        for d in deployments
        for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    urls = service_urls(services, deployments, ports)
    router_local = urls[f"http://demo-router.{NS}.svc:{spec.router.port}"]
    registry_local = urls[f"http://demo-router-internal.{NS}.svc:{spec.router.internal_port}"]
    # The mounted cluster-token Secret, as the kubelet would project it.
    secret_dir = tmp_path / "cluster-token"
    secret_dir.mkdir()
    (secret_dir / "token").write_text(CLUSTER_TOKEN + "\n")
    pods = []
    for d in deployments:
        pod_tmp = tmp_path / d["metadata"]["name"]
        pod_tmp.mkdir()
        mounts = {"/tmp": str(pod_tmp), "/etc/tandem/cluster-token": str(secret_dir)}
        pods.append(local_pod(d, config_maps, ports, urls, mounts))
    assert pods[0].deployment == "demo-router"
    assert router_local == f"http://127.0.0.1:{pods[0].port}"
    running: list[LocalProcess] = []
    try:
        for pod in pods:
            # The host's environment minus any token: the pods read theirs from the file.
            host = {k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_TOKEN"}
            running.append(LocalProcess(pod.argv, tmp_path, pod.deployment, {**host, **pod.env}))
        for pod, proc in zip(pods, running, strict=True):
            proc.wait_http_ok(f"http://127.0.0.1:{pod.port}{pod.readiness_path}", 120)

        def registered() -> list[dict[str, Any]] | None:
            for proc in running:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
            r = httpx.get(f"{registry_local}/internal/workers", headers=AUTH, timeout=2)
            workers = r.json()["workers"]
            return workers if len(workers) == 2 else None

        workers = poll("both workers registered with the rendered router", registered, 60)
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        # Registered under the downward-API pod IP (TANDEM_ADVERTISE_HOST=$(POD_IP)) and port.
        worker_ports = {pods[1].port, pods[2].port}
        assert {w["url"] for w in workers} == {f"http://127.0.0.1:{p}" for p in worker_ports}
        with httpx.Client(base_url=router_local, timeout=30) as client:
            for s in ["abc", *held_out_inputs(3)]:
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "demo",
                        "messages": [{"role": "user", "content": make_user_message(s)}],
                        "temperature": 0,
                        "max_tokens": 16,
                    },
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == expected_answer(s)
            # The sample prefills prompts under 32 tokens on decode, which the demo questions
            # are. A longer prompt goes through the prefill pod and the rendered KV transport;
            # greedy output must equal the offline engine's, token for token.
            prompt = f"<|bos|><|system|>{'the quick brown fox jumps over the lazy dog ' * 2}"
            prompt += "<|user|>reverse: abc<|assistant|>"
            remote_before = remote_prefills(client)
            r = client.post(
                "/v1/completions",
                json={"model": "demo", "prompt": prompt, "temperature": 0, "max_tokens": 12},
            )
            assert r.status_code == 200, r.text
            assert remote_prefills(client) == remote_before + 1
            (decode_pod,) = [p for p in pods if p.deployment == "demo-decode"]
            decode_metrics = httpx.get(f"http://127.0.0.1:{decode_pod.port}/metrics").text
            received = Snapshot.parse(decode_metrics).total(
                "tandem_kv_transfer_bytes_total",
                lambda labels: (
                    labels.get("direction") == "recv" and labels.get("transport") == "tcp"
                ),
            )
            assert received > 0
        offline = LLM(model="demo").generate([prompt], SamplingParams(temperature=0, max_tokens=12))
        assert r.json()["choices"][0]["text"] == offline[0].text
    finally:
        for proc in reversed(running):
            proc.stop()
