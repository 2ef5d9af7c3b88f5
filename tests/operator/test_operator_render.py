"""Spec parsing, child rendering, status and reconcile helpers (all pure), and schema checks:
samples against the CRD's openAPIV3Schema, rendered children against Kubernetes' schemas."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from render_lib import (
    CRD_FILE,
    K8S_VERSION,
    OWNER,
    SAMPLES,
    by_name,
    gpu_spec,
    load_docs,
)

from tandem.operator.children import (
    CONFIG_HASH_ANNOTATION,
    Replicas,
    render_children,
)
from tandem.operator.reconcile import (
    LAST_APPLIED,
    PoolStatus,
    child_patch,
    is_subset,
    pod_info,
    removal_patch,
)
from tandem.operator.scaling import effective_replicas
from tandem.operator.spec import MetricsSource, SpecError, TandemServiceSpec, parse_spec
from tandem.operator.status import DegradedReason, Problem, build_status


def crd_schema() -> dict[str, Any]:
    (crd,) = load_docs(CRD_FILE)
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def validate_custom(obj: dict[str, Any]) -> None:
    # Kubernetes structural schemas are OpenAPI 3.0: boolean exclusiveMinimum, as in Draft 4.
    jsonschema.Draft4Validator(crd_schema()).validate(obj)


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to `value`."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


@pytest.mark.parametrize("obj", [d for _, d in SAMPLES], ids=[n for n, _ in SAMPLES])
def test_samples_validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "TandemService":
        validate_custom(obj)
        spec = parse_spec(apply_defaults(crd_schema()["properties"]["spec"], obj["spec"]))
        assert spec.autoscaling.enabled
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_crd_defaults_match_operator_defaults() -> None:
    spec_schema = crd_schema()["properties"]["spec"]
    defaulted = apply_defaults(spec_schema, {})
    assert parse_spec(defaulted) == parse_spec({}) == TandemServiceSpec()
    assert defaulted["autoscaling"]["metrics"]["source"] == "direct"


@pytest.mark.parametrize(
    "patch",
    [
        {"router": {"policy": "random"}},
        {"prefill": {"replicas": -1}},
        {"kvTransfer": {"transport": "rdma"}},
        {"autoscaling": {"ttftSeconds": 0}},
        {"autoscaling": {"kvCacheUsage": 1.5}},
        {"autoscaling": {"intervalSeconds": 1}},
        {"decode": {"engineOptions": {"max_num_seqs": True}}},
        {"model": {"pvc": {"mountPath": "/x"}}},
        {"unknownField": 1},
        {"workload": {"inputTokens": 100, "outputTokens": 10}},
        {"workload": {"inputTokens": 0, "outputTokens": 10, "requestsPerSecond": 1}},
        {"workload": {"inputTokens": 9, "outputTokens": 9, "requestsPerSecond": 0}},
        {
            "workload": {
                "inputTokens": 9,
                "outputTokens": 9,
                "requestsPerSecond": 1,
                "prefixShare": 1,
            }
        },
        {
            "workload": {
                "inputTokens": 9,
                "outputTokens": 9,
                "requestsPerSecond": 1,
                "profile": {"key": "p.json"},
            }
        },
        {"autoscaling": {"planner": "yes"}},
    ],
)
def test_schema_refuses_bad_specs(patch: dict[str, Any]) -> None:
    obj = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemService",
        "metadata": {"name": "x"},
        "spec": patch,
    }
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(obj)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"autoscaling": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}},
            "spec.autoscaling.prefill.minReplicas (5) is greater than "
            "spec.autoscaling.prefill.maxReplicas (2)",
        ),
        (
            {"autoscaling": {"metrics": {"source": "prometheus"}}},
            "spec.autoscaling.metrics.prometheusUrl must be an http(s) URL when source is "
            "prometheus",
        ),
        ({"decode": {"replicas": 0}}, "spec.decode.replicas must be >= 1"),
        ({"prefill": {"port": 8000}}, "must differ"),
        ({"model": {"path": "/data/m", "pvc": {"claimName": "c"}}}, "outside the PVC mount"),
        ({"prefill": {"engineOptions": {"--x": 1}}}, "must be a bare option name"),
        (
            {"autoscaling": {"enabled": True, "planner": True}},
            "spec.autoscaling.planner needs spec.autoscaling.enabled and spec.workload",
        ),
        (
            {
                "autoscaling": {"planner": True},
                "workload": {"inputTokens": 9, "outputTokens": 9, "requestsPerSecond": 1},
            },
            "spec.autoscaling.planner needs spec.autoscaling.enabled",
        ),
    ],
)
def test_operator_refuses_what_schema_cannot(spec: dict[str, Any], message: str) -> None:
    obj = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemService",
        "metadata": {"name": "x"},
        "spec": spec,
    }
    validate_custom(obj)  # the schema lets it through...
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert message in str(err.value)


def test_render_children_names_and_owner() -> None:
    children = render_children(OWNER, TandemServiceSpec(), Replicas(prefill=2, decode=3))
    assert list(by_name(children)) == [
        "ConfigMap/demo-config",
        "Deployment/demo-router",
        "Deployment/demo-prefill",
        "Deployment/demo-decode",
        "Service/demo-router",
        "Service/demo-prefill",
        "Service/demo-decode",
        "Service/demo-router-internal",
    ]
    for child in children:
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "TandemService",
            "name": "demo",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["labels"]["tandem.dev/service"] == "demo"
    named = by_name(children)
    assert named["Deployment/demo-prefill"]["spec"]["replicas"] == 2
    assert named["Deployment/demo-decode"]["spec"]["replicas"] == 3


def test_render_commands() -> None:
    named = by_name(render_children(OWNER, gpu_spec(), Replicas(prefill=2, decode=2)))
    router = named["Deployment/demo-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["tandem"]
    assert router["args"] == [
        "router",
        "--model",
        "/models/llama-3-8b-instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--internal-port",
        "8001",
        "--cluster-token-file",
        "/etc/tandem/cluster-token/token",
        "--policy",
        "prefix-aware",
        "--local-prefill-threshold",
        "128",
        "--served-model-name",
        "llama-3-8b-instruct",
        "--api-key-file",
        "/etc/tandem/api-key/api-key",
    ]
    decode = named["Deployment/demo-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert decode["args"] == [
        "decode",
        "--model",
        "/models/llama-3-8b-instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8200",
        "--router-url",
        "http://demo-router-internal.llm.svc:8001",
        "--cluster-token-file",
        "/etc/tandem/cluster-token/token",
        "--kv-transport",
        "ucx",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--kv-events-port",
        "8201",
        "--served-model-name",
        "llama-3-8b-instruct",
        "--engine-option",
        "gpu_memory_utilization=0.9",
        "--engine-option",
        "max_num_seqs=256",
    ]
    assert decode["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "48Gi", "nvidia.com/gpu": "1"},
    }
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in decode["volumeMounts"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert decode[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The drain route needs the cluster token, which an httpGet hook cannot send.
    assert decode["lifecycle"] == {
        "preStop": {
            "exec": {
                "command": [
                    "tandem",
                    "drain",
                    "--port",
                    "8200",
                    "--timeout",
                    "50",
                    "--cluster-token-file",
                    "/etc/tandem/cluster-token/token",
                ]  # fmt: skip
            }
        }
    }
    assert "lifecycle" not in router
    assert decode["ports"] == [
        {"name": "http", "containerPort": 8200, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 8201, "protocol": "TCP"},
    ]
    prefill = named["Deployment/demo-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert prefill["args"][prefill["args"].index("--kv-events-port") :][:6] == [
        "--kv-events-port", "8101", "--kv-side-channel-port", "8102", "--kv-data-port", "8103",
    ]  # fmt: skip
    assert [p["containerPort"] for p in prefill["ports"]] == [8100, 8101, 8102, 8103]


def test_render_security_and_metrics_labels() -> None:
    for child in render_children(OWNER, gpu_spec(), Replicas(1, 1)):
        if child["kind"] != "Deployment":
            continue
        template = child["spec"]["template"]
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert template["metadata"]["labels"]["tandem.dev/metrics"] == "true"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(container["ports"][0]["containerPort"])


def test_headless_worker_services() -> None:
    named = by_name(render_children(OWNER, TandemServiceSpec(), Replicas(1, 1)))
    assert named["Service/demo-prefill"]["spec"]["clusterIP"] == "None"
    assert named["Service/demo-decode"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in named["Service/demo-router"]["spec"]
    assert named["Service/demo-router"]["spec"]["type"] == "ClusterIP"


def test_config_change_rolls_pods() -> None:
    a = by_name(render_children(OWNER, TandemServiceSpec(), Replicas(1, 1)))
    b_spec = parse_spec({"kvTransfer": {"transport": "tcp"}})
    b = by_name(render_children(OWNER, b_spec, Replicas(1, 1)))

    def cfg_hash(children: dict[str, Any]) -> str:
        return children["Deployment/demo-decode"]["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION
        ]

    assert cfg_hash(a) != cfg_hash(b)
    assert a["ConfigMap/demo-config"]["data"]["TANDEM_KV_TRANSPORT"] == "ucx"


def test_rendering_is_deterministic() -> None:
    first = render_children(OWNER, gpu_spec(), Replicas(2, 3))
    again = render_children(OWNER, gpu_spec(), Replicas(2, 3))
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)


@pytest.mark.parametrize("spec_name", ["default", "gpu"])
def test_rendered_children_validate_against_kubernetes(spec_name: str) -> None:
    spec = TandemServiceSpec() if spec_name == "default" else gpu_spec()
    for child in render_children(OWNER, spec, Replicas(2, 2)):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_child_patch_idempotent_and_repairs_drift() -> None:
    desired = by_name(render_children(OWNER, TandemServiceSpec(), Replicas(1, 1)))[
        "Deployment/demo-decode"
    ]
    patch = child_patch(desired, {"metadata": {}})
    assert patch is not None
    live = {**copy.deepcopy(patch), "apiVersion": "apps/v1", "kind": "Deployment"}
    # The API server adds fields (defaults, status): still in sync.
    live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    live["status"] = {"readyReplicas": 1}
    assert child_patch(desired, live) is None
    # Someone scales it by hand: the patch puts it back.
    live["spec"]["replicas"] = 7
    assert child_patch(desired, live)["spec"]["replicas"] == 1


def test_child_patch_removes_dropped_fields() -> None:
    old_spec = parse_spec({"decode": {"nodeSelector": {"gpu": "a100"}}})
    old = by_name(render_children(OWNER, old_spec, Replicas(1, 1)))["Deployment/demo-decode"]
    live = child_patch(old, {"metadata": {}})
    assert live is not None
    new = by_name(render_children(OWNER, TandemServiceSpec(), Replicas(1, 1)))[
        "Deployment/demo-decode"
    ]
    patch = child_patch(new, live)
    assert patch is not None
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None
    assert LAST_APPLIED in patch["metadata"]["annotations"]


def test_subset_and_removal_patch() -> None:
    assert is_subset({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2, "c": 3}], "d": 4})
    assert not is_subset({"a": [1]}, {"a": [1, 2]})
    assert not is_subset({"a": {"b": 1}}, {"a": 1})
    assert removal_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 2}}) == {
        "a": None,
        "b": {"c": 2, "d": None},
    }


def pools(router: int, prefill: int, decode: int, replicas: int = 1) -> dict[str, PoolStatus]:
    def p(ready: int) -> PoolStatus:
        return PoolStatus(replicas, ready, replicas, ready, True)

    return {"router": p(router), "prefill": p(prefill), "decode": p(decode)}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_ready_and_progressing() -> None:
    ready = build_status(3, pools(1, 1, 1), "http://x", None, [], "T1")
    assert conditions(ready) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert ready["observedGeneration"] == 3
    assert ready["decode"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}
    assert ready["endpoint"] == "http://x"
    rolling = build_status(4, pools(1, 0, 0), "http://x", None, ready["conditions"], "T2")
    assert conditions(rolling)["Ready"] == ("False", "MinimumReplicasUnavailable")
    assert conditions(rolling)["Progressing"] == ("True", "RollingOut")
    by_type = {c["type"]: c for c in rolling["conditions"]}
    assert by_type["Ready"]["lastTransitionTime"] == "T2"
    assert by_type["Degraded"]["lastTransitionTime"] == "T1"  # unchanged since T1


def test_status_degraded_keeps_observed_generation() -> None:
    problem = Problem(DegradedReason.INVALID_SPEC, "min > max")
    status = build_status(5, pools(1, 1, 1), None, problem, [], "T")
    assert conditions(status)["Degraded"] == ("True", "InvalidSpec")
    assert "observedGeneration" not in status
    missing = build_status(
        1, {"router": None, "prefill": None, "decode": None}, None, None, [], "T"
    )
    assert conditions(missing)["Ready"] == ("False", "ChildrenMissing")


def test_effective_replicas() -> None:
    plain = parse_spec({"prefill": {"replicas": 3}, "decode": {"replicas": 2}})
    assert effective_replicas(plain, {"autoscaling": {"prefill": {"desiredReplicas": 9}}}) == (
        Replicas(3, 2)
    )
    scaled = parse_spec({"prefill": {"replicas": 3}, "autoscaling": {"enabled": True}})
    assert effective_replicas(scaled, {}) == Replicas(3, 1)
    status = {"autoscaling": {"prefill": {"desiredReplicas": 9}, "decode": {"desiredReplicas": 2}}}
    assert effective_replicas(scaled, status) == Replicas(4, 2)  # clamped to max 4
    # The planner's starting counts stand until the autoscaler's first decision.
    planned = parse_spec(
        {
            "prefill": {"replicas": 3},
            "autoscaling": {"enabled": True, "planner": True, "decode": {"maxReplicas": 8}},
            "workload": {"inputTokens": 9, "outputTokens": 9, "requestsPerSecond": 1},
        }
    )
    start = {"autoscaling": {"planner": {"startReplicas": {"prefill": 2, "decode": 6}}}}
    assert effective_replicas(planned, start) == Replicas(2, 6)
    decided = {"autoscaling": {**start["autoscaling"], "decode": {"desiredReplicas": 3}}}
    assert effective_replicas(planned, decided) == Replicas(2, 3)
    assert effective_replicas(scaled, start) == Replicas(3, 1)  # planner off: ignored


def test_pod_info_readiness_and_age() -> None:
    import datetime

    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    pod = {
        "metadata": {"name": "demo-decode-x", "labels": {"tandem.dev/pool": "decode"}},
        "status": {
            "podIP": "10.1.2.3",
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T11:59:00Z"}
            ],
        },
    }
    info = pod_info(pod, TandemServiceSpec(), now)
    assert (info.pool, info.ip, info.port, info.ready, info.ready_seconds) == (
        "decode",
        "10.1.2.3",
        8200,
        True,
        60.0,
    )
    assert info.warm(60) and not info.warm(61)


def test_metrics_source_parsing() -> None:
    spec = parse_spec(
        {"autoscaling": {"metrics": {"source": "prometheus", "prometheusUrl": "http://p:9090/"}}}
    )
    assert spec.autoscaling.metrics.source is MetricsSource.PROMETHEUS
    assert spec.autoscaling.metrics.prometheus_url == "http://p:9090"


def test_drifted_compares_against_last_applied() -> None:
    from tandem.operator.reconcile import drifted

    desired = by_name(render_children(OWNER, TandemServiceSpec(), Replicas(1, 1)))[
        "Service/demo-router"
    ]
    live = child_patch(desired, {"metadata": {}})
    assert live is not None
    live = {**live, "apiVersion": "v1", "kind": "Service", "status": {"loadBalancer": {}}}
    assert not drifted(live)
    live["spec"]["type"] = "NodePort"
    assert drifted(live)
    assert drifted({"metadata": {"annotations": {LAST_APPLIED: "not json"}}})
    assert drifted({"metadata": {}})


def test_object_paths() -> None:
    from tandem.operator.kube import object_path

    assert (
        object_path("apps/v1", "Deployment", "ns", "d")
        == "/apis/apps/v1/namespaces/ns/deployments/d"
    )
    assert object_path("v1", "Pod", "ns") == "/api/v1/namespaces/ns/pods"
    assert (
        object_path("tandem.dev/v1alpha1", "TandemService", "ns", "x", "status")
        == "/apis/tandem.dev/v1alpha1/namespaces/ns/tandemservices/x/status"
    )


@pytest.mark.parametrize(
    "argv",
    [[], ["-A", "--resync-seconds", "0"], ["-A", "--metrics-port", "70000"], ["-A", "-n", "x"]],
)
def test_cli_rejects_bad_arguments(argv: list[str]) -> None:
    from tandem.operator.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_operator_imports_stay_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tandem.operator.cli, tandem.operator.handlers; "
        "heavy = {'torch', 'transformers', 'triton'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60)
