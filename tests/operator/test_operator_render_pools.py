"""Rendering for real clusters (all pure): the router command's flags, the cluster-token Secret
mounted in every pod and held by no child, the headless internal Service, GPU pools' device and
dtype from their resources, engineOptions that collide with first-class fields, fingerprint
labels on worker pods."""

from __future__ import annotations

import json
from typing import Any

import pytest
from render_lib import (
    OWNER,
    SAMPLES,
    by_name,
    gpu_spec,
)

from tandem.operator.children import (
    Replicas,
    render_children,
)
from tandem.operator.spec import SpecError, TandemServiceSpec, parse_spec


def test_prefill_overload_queue_reaches_the_router_command() -> None:
    doc = next(d for n, d in SAMPLES if n.startswith("gpu-pvc.yaml:TandemService"))
    spec = parse_spec(
        {**doc["spec"], "router": {**doc["spec"]["router"], "prefillOverloadQueue": 6}}
    )
    named = by_name(render_children(OWNER, spec, Replicas(prefill=1, decode=1)))
    args = named["Deployment/demo-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    i = args.index("--prefill-overload-queue")
    assert args[i + 1] == "6"
    assert "--prefill-overload-queue" not in json.dumps(
        render_children(OWNER, gpu_spec(), Replicas(prefill=1, decode=1))
    )
    with pytest.raises(SpecError, match="prefillOverloadQueue must be >= 0"):
        parse_spec({"router": {"prefillOverloadQueue": -1}})


def test_every_pod_mounts_the_cluster_token_secret_and_no_child_holds_a_token() -> None:
    children = render_children(OWNER, gpu_spec(), Replicas(2, 2))
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert len(deployments) == 3
    for d in deployments:
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volume = next(v for v in pod["volumes"] if v["name"] == "cluster-token")
        assert volume["secret"]["secretName"] == "demo-cluster-token"
        # not a subPath: a rotated Secret reaches the running pod
        assert {"name": "cluster-token", "mountPath": "/etc/tandem/cluster-token",
                "readOnly": True} in container["volumeMounts"]  # fmt: skip
        args = container["args"]
        assert args[args.index("--cluster-token-file") + 1] == "/etc/tandem/cluster-token/token"
        assert not any("TOKEN" in e["name"] for e in container["env"])
    assert not any(c["kind"] == "Secret" for c in children)  # made once, never rendered


def test_internal_service_is_headless_and_separate_from_the_public_one() -> None:
    named = by_name(render_children(OWNER, gpu_spec(), Replicas(1, 1)))
    internal = named["Service/demo-router-internal"]["spec"]
    assert internal["clusterIP"] == "None"
    assert internal["ports"] == [
        {"name": "internal", "port": 8001, "targetPort": "internal", "protocol": "TCP"}
    ]
    public = named["Service/demo-router"]["spec"]
    assert [p["name"] for p in public["ports"]] == ["http"]
    router = named["Deployment/demo-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["ports"][1] == {"name": "internal", "containerPort": 8001, "protocol": "TCP"}


def _worker_flags(spec: TandemServiceSpec, pool: str) -> dict[str, Any]:
    named = by_name(render_children(OWNER, spec, Replicas(1, 1)))
    (c,) = named[f"Deployment/demo-{pool}"]["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    return {
        "device": args[args.index("--device") + 1],
        "dtype": args[args.index("--dtype") + 1],
        "gpus": c["resources"].get("limits", {}).get("nvidia.com/gpu"),
    }


@pytest.mark.parametrize(
    ("sample", "pool", "expected"),
    [
        ("demo-cpu.yaml", "prefill", {"device": "cpu", "dtype": "float32", "gpus": None}),
        ("demo-cpu.yaml", "decode", {"device": "cpu", "dtype": "float32", "gpus": None}),
        ("gpu-pvc.yaml", "prefill", {"device": "cuda", "dtype": "bfloat16", "gpus": "1"}),
        ("gpu-pvc.yaml", "decode", {"device": "cuda", "dtype": "bfloat16", "gpus": "1"}),
    ],
)
def test_samples_render_device_and_dtype_from_their_resources(
    sample: str, pool: str, expected: dict[str, Any]
) -> None:
    doc = next(d for n, d in SAMPLES if n.startswith(f"{sample}:TandemService"))
    assert _worker_flags(parse_spec(doc["spec"]), pool) == expected


def test_explicit_device_and_dtype_win() -> None:
    spec = parse_spec({"decode": {"device": "cuda:1", "dtype": "float16",
                                  "resources": {"limits": {"nvidia.com/gpu": 2}}},
                       "prefill": {"dtype": "bfloat16"}})  # fmt: skip
    assert _worker_flags(spec, "decode") == {"device": "cuda:1", "dtype": "float16", "gpus": "2"}
    assert _worker_flags(spec, "prefill") == {"device": "cpu", "dtype": "bfloat16", "gpus": None}


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"device": "cuda"}, "spec.decode.device"),
        ({"dtype": "float16"}, "spec.decode.dtype"),
        ({"served-model-name": "x"}, "model.name"),
        ({"model": "/other"}, "model"),
    ],
)
def test_engine_options_may_not_collide_with_first_class_fields(
    options: dict[str, str], names: str
) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"decode": {"engineOptions": options}})
    assert "collides" in str(e.value) and names in str(e.value)
    assert f"spec.decode.engineOptions.{next(iter(options))}" in str(e.value)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu"])
def test_bad_device_is_refused(device: str) -> None:
    with pytest.raises(SpecError, match="device"):
        parse_spec({"prefill": {"device": device}})


def _fingerprint_label(spec: TandemServiceSpec, pool: str) -> str:
    named = by_name(render_children(OWNER, spec, Replicas(1, 1)))
    return named[f"Deployment/demo-{pool}"]["spec"]["template"]["metadata"]["labels"][
        "tandem.dev/fingerprint"
    ]


def test_worker_pods_carry_their_fingerprint_label() -> None:
    spec = gpu_spec()
    assert _fingerprint_label(spec, "prefill") == _fingerprint_label(spec, "decode")
    router = by_name(render_children(OWNER, spec, Replicas(1, 1)))["Deployment/demo-router"]
    assert "tandem.dev/fingerprint" not in router["spec"]["template"]["metadata"]["labels"]
    raw = next(d for n, d in SAMPLES if n.startswith("gpu-pvc.yaml:TandemService"))["spec"]
    new_image = parse_spec({**raw, "image": "ghcr.io/tandem-llm/tandem:0.2.0"})
    assert _fingerprint_label(new_image, "decode") != _fingerprint_label(spec, "decode")
    fp16 = parse_spec({**raw, "decode": {**raw["decode"], "dtype": "float16"}})
    assert _fingerprint_label(fp16, "decode") != _fingerprint_label(fp16, "prefill")
    more_seqs = parse_spec({**raw, "decode": {**raw["decode"],
                                              "engineOptions": {"max_num_seqs": 8}}})  # fmt: skip
    assert _fingerprint_label(more_seqs, "decode") == _fingerprint_label(spec, "decode")
