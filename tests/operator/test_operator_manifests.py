"""Static checks of manifests/: Kubernetes schemas, kustomize builds, security settings,
the dashboard's PromQL (promtool), the monitors' labels and the Dockerfile."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dashboard import dashboard_exprs, dashboard_panels, dashboard_queries

from tandem.operator.naming import POOL_LABEL, SERVICE_LABEL
from tandem.operator.spec import DEFAULT_SELECTOR

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
K8S_VERSION = "1.32.0"
BUILTIN = [
    "namespace.yaml",
    "crd/tandemservices.tandem.dev.yaml",
    "rbac/service-account.yaml",
    "rbac/cluster-role.yaml",
    "rbac/cluster-role-binding.yaml",
    "operator/deployment.yaml",
    "operator/service.yaml",
]
DESIGN_METRICS = {
    "tandem_requests_running",
    "tandem_requests_waiting",
    "tandem_kv_cache_usage_ratio",
    "tandem_prefix_cache_queried_tokens_total",
    "tandem_prefix_cache_hit_tokens_total",
    "tandem_prompt_tokens_total",
    "tandem_generation_tokens_total",
    "tandem_preemptions_total",
    "tandem_kv_transfer_bytes_total",
    "tandem_kv_transfer_seconds_bucket",
    "tandem_kv_transfer_failures_total",
    "tandem_router_requests_total",
    "tandem_time_to_first_token_seconds_bucket",
    "tandem_inter_token_latency_seconds_bucket",
    "tandem_e2e_request_latency_seconds_bucket",
    "tandem_router_placements_total",
}
WORKER_LATENCY_METRICS = {  # beyond DESIGN.md's list (engine/worker/metrics.py RequestLatency)
    "tandem_worker_queue_time_seconds_bucket",
    "tandem_worker_time_to_first_token_seconds_bucket",
    "tandem_worker_request_duration_seconds_bucket",
}
OPERATOR_METRICS = {
    "tandem_pool_replicas",
    "tandem_autoscaler_desired_replicas",
    "tandem_autoscaler_load_ratio",
    "tandem_autoscaler_decisions_total",
    "tandem_operator_reconciles_total",
}


def load(path: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / path).read_text()) if d]


@pytest.mark.parametrize("path", BUILTIN)
def test_builtin_manifests_validate(path: str) -> None:
    for doc in load(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_every_operator_manifest() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["resources"] == BUILTIN


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", ["", "samples", "monitoring", "security"])
def test_kustomize_builds(folder: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(MANIFESTS / folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    expected = {
        "": [
            "Namespace",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
        ],
        "samples": ["TandemService"],
        "monitoring": ["ConfigMap", "ServiceMonitor", "PodMonitor"],
        "security": ["NetworkPolicy", "NetworkPolicy"],
    }[folder]
    assert sorted(kinds) == sorted(expected)


def test_operator_pod_is_locked_down() -> None:
    (deployment,) = load("operator/deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "tandem-operator"
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["args"][:3] == ["operator", "--all-namespaces", "--standalone"]
    assert deployment["spec"]["replicas"] == 1


def test_rbac_has_no_wildcards() -> None:
    (role,) = load("rbac/cluster-role.yaml")
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key]
        assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
    (binding,) = load("rbac/cluster-role-binding.yaml")
    (sa,) = load("rbac/service-account.yaml")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"],
        }
    ]


def test_dashboard_uses_only_known_metrics() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = {m for _, e in exprs for m in re.findall(r"\b(tandem_[a-z0-9_]+)[{\[]", e)}
    assert len(used) >= 17
    known = DESIGN_METRICS | WORKER_LATENCY_METRICS | OPERATOR_METRICS
    assert used <= known, used - known
    titles = " ".join(p["title"] for p in dashboard_panels()).lower()
    for topic in (
        "time to first token",
        "inter-token",
        "end-to-end",
        "waiting",
        "kv cache",
        "prefix cache",
        "kv transfer bandwidth",
        "failures",
        "replicas",
        "decisions",
        "worker time to first token",
    ):
        assert topic in titles


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (apt-get install prometheus)",
)
def test_dashboard_promql_parses(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q}
                    for i, q in enumerate(dashboard_queries("ns", "demo"))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_pod_monitor_adds_the_labels_the_autoscaler_selects() -> None:
    (monitor,) = load("monitoring/pod-monitor.yaml")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}

    def meta(label: str) -> list[str]:
        return ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)]

    assert targets["tandem_service"] == meta(SERVICE_LABEL)
    assert targets["pool"] == meta(POOL_LABEL)
    assert "tandem_service=" in DEFAULT_SELECTOR
    assert monitor["spec"]["selector"]["matchLabels"]["tandem.dev/metrics"] == "true"


def test_dockerfile_installs_every_package_folder() -> None:
    text = (MANIFESTS / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \./\S+$", text, flags=re.M))
    assert folders <= copied, folders - copied
    assert "torch==2.13.0" in text and "whl/cpu" in text
    assert re.search(r"^USER 10001", text, flags=re.M)
    assert text.index("pip install --index-url") < text.index('pip install ".')


def _admitted(policy: dict[str, Any], labels: dict[str, str], port: int) -> bool:
    """Whether ``policy`` admits a pod carrying ``labels`` (same namespace) to ``port``."""

    def selects(sel: dict[str, Any]) -> bool:
        ok = all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())
        for e in sel.get("matchExpressions") or []:
            assert e["operator"] == "In"
            ok = ok and labels.get(e["key"]) in e["values"]
        return ok

    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        peer_ok = peers is None or any(
            "namespaceSelector" not in peer and selects(peer["podSelector"]) for peer in peers
        )
        port_ok = any(
            p["port"] <= port <= p.get("endPort", p["port"]) for p in rule.get("ports") or []
        )
        if peer_ok and port_ok:
            return True
    return False


def test_network_policy_matches_the_rendered_ports_and_admits_only_whom_it_should() -> None:
    """The policy's ports are the operator's rendering of the samples: every port a rendered
    pod declares is admitted from exactly the peers that need it, and nothing else is."""
    from tandem.operator.children import Owner, Replicas, render_children
    from tandem.operator.naming import UCX_TCP_PORT_RANGE
    from tandem.operator.spec import parse_spec

    for doc in load("security/network-policy.yaml"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    router_pol, workers_pol = load("security/network-policy.yaml")
    sample = next(d for d in load("samples/demo-cpu.yaml") if d["kind"] == "TandemService")
    children = render_children(Owner("demo", "ns", "u"), parse_spec(sample["spec"]),
                               Replicas(1, 1))  # fmt: skip
    pods = {}
    for d in children:
        if d["kind"] == "Deployment":
            template = d["spec"]["template"]
            (container,) = template["spec"]["containers"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            pods[d["metadata"]["labels"]["app.kubernetes.io/component"]] = (
                template["metadata"]["labels"], ports,
            )  # fmt: skip
    router, prefill, decode = (pods[n][0] for n in ("router", "prefill", "decode"))
    stranger = {"app.kubernetes.io/name": "something-else"}
    rp, pp, dp = (pods[n][1] for n in ("router", "prefill", "decode"))
    # router: public port from anyone; registry only from workers
    assert _admitted(router_pol, stranger, rp["http"])
    assert _admitted(router_pol, prefill, rp["internal"]) and _admitted(
        router_pol, decode, rp["internal"]
    )
    assert not _admitted(router_pol, stranger, rp["internal"])
    # workers: internal API and KV events only from the router; KV ports only from workers
    for ports in (pp, dp):
        for name in ("http", "kv-events"):
            assert _admitted(workers_pol, router, ports[name])
            assert not _admitted(workers_pol, stranger, ports[name])
            assert not _admitted(workers_pol, decode, ports[name])  # workers: KV ports only
    for name in ("kv-side", "kv-data"):
        assert _admitted(workers_pol, decode, pp[name])
        assert not _admitted(workers_pol, router, pp[name])
        assert not _admitted(workers_pol, stranger, pp[name])
    lo, hi = UCX_TCP_PORT_RANGE
    assert _admitted(workers_pol, decode, lo) and _admitted(workers_pol, prefill, hi)
    assert not _admitted(workers_pol, router, lo)
