"""Render a TandemService's children (Deployments, Services, ConfigMap) as pure functions.

Called by the reconciler on every create/update/resume/timer pass; the same spec and replica
counts always give the same manifests, which is what makes reconciliation idempotent. The
reconciler owns the API calls; nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tandem.operator.spec import PoolSpec, Resources, TandemServiceSpec

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TandemService"
PLURAL = "tandemservices"
MANAGED_BY = "tandem-operator"
SERVICE_LABEL = "tandem.dev/service"
POOL_LABEL = "tandem.dev/pool"
CONFIG_HASH_ANNOTATION = "tandem.dev/config-hash"
POOLS = ("router", "prefill", "decode")
RUN_AS_USER = 10001


@dataclass(frozen=True, slots=True)
class Owner:
    """Identity of the TandemService that owns (and is the controller of) every child."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True, slots=True)
class Replicas:
    """Worker replica counts to render: spec values, or the autoscaler's decisions."""

    prefill: int
    decode: int


def child_name(owner_name: str, pool: str) -> str:
    return f"{owner_name}-{pool}"


def config_map_name(owner_name: str) -> str:
    return f"{owner_name}-config"


def router_url(owner: Owner, spec: TandemServiceSpec) -> str:
    return f"http://{child_name(owner.name, 'router')}.{owner.namespace}.svc:{spec.router.port}"


def selector_labels(owner_name: str, pool: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": owner_name,
        "app.kubernetes.io/component": pool,
    }


def common_labels(owner_name: str, pool: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": owner_name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "tandem",
        SERVICE_LABEL: owner_name,
    }
    if pool is not None:
        labels["app.kubernetes.io/component"] = pool
        labels[POOL_LABEL] = pool
    return labels


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str, pool: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name, pool),
        "ownerReferences": [owner_reference(owner)],
    }


def render_config_map(owner: Owner, spec: TandemServiceSpec) -> dict[str, Any]:
    """Environment shared by every pod; its hash rolls the pods when it changes."""
    data = {
        "TANDEM_MODEL": spec.model.argument,
        "TANDEM_SERVED_MODEL_NAME": spec.model.name,
        "TANDEM_ROUTER_URL": router_url(owner, spec),
        "TANDEM_KV_TRANSPORT": spec.kv_transport,
        # Nothing is downloaded at run time, and the root filesystem is read-only: caches go
        # to the writable /tmp volume.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOME": "/tmp",
        "XDG_CACHE_HOME": "/tmp/.cache",
        "TRITON_CACHE_DIR": "/tmp/.triton",
        "PYTHONUNBUFFERED": "1",
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, config_map_name(owner.name), None),
        "data": data,
    }


def config_hash(config_map: dict[str, Any]) -> str:
    text = json.dumps(config_map["data"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _resources(resources: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = dict(sorted(resources.requests.items()))
    if resources.limits:
        out["limits"] = dict(sorted(resources.limits.items()))
    return out


def _probe(path: str, period: int, failures: int, initial: int = 0) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


def router_args(owner: Owner, spec: TandemServiceSpec) -> list[str]:
    args = [
        "router",
        "--model",
        spec.model.argument,
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.router.port),
        "--policy",
        spec.router.policy,
        "--local-prefill-threshold",
        str(spec.router.local_prefill_threshold),
    ]
    if spec.router.prefill_overload_queue > 0:
        args += ["--prefill-overload-queue", str(spec.router.prefill_overload_queue)]
    if spec.model.argument != spec.model.name:
        # The router loads the tokenizer from the model path and serves it under the name.
        args += ["--served-model-name", spec.model.name]
    if spec.router.api_key_secret is not None:
        args += ["--api-key-file", f"/etc/tandem/api-key/{spec.router.api_key_secret.key}"]
    return args


def worker_args(owner: Owner, spec: TandemServiceSpec, role: str) -> list[str]:
    pool = spec.prefill if role == "prefill" else spec.decode
    args = [
        role,
        "--model",
        spec.model.argument,
        "--host",
        "0.0.0.0",
        "--port",
        str(pool.port),
        "--router-url",
        router_url(owner, spec),
        "--kv-transport",
        spec.kv_transport,
    ]
    if spec.model.argument != spec.model.name:
        args += ["--served-model-name", spec.model.name]
    for key, value in sorted(pool.engine_options.items()):
        args += ["--engine-option", f"{key}={value}"]
    return args


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _deployment(
    owner: Owner,
    spec: TandemServiceSpec,
    pool: str,
    replicas: int,
    port: int,
    args: list[str],
    resources: Resources,
    cfg_hash: str,
    worker: PoolSpec | None,
) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Workers register this address with the router and use it for the KV side channel.
        {"name": "TANDEM_ADVERTISE_HOST", "value": "$(POD_IP)"},
        {"name": "TANDEM_ROLE", "value": pool},
    ]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if worker is not None:
        # torch and UCX use /dev/shm; the default 64 MiB is too small for KV staging.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        if spec.model.pvc is not None:
            pvc = spec.model.pvc
            volumes.append(
                {
                    "name": "model",
                    "persistentVolumeClaim": {
                        "claimName": pvc.claim_name,
                        "readOnly": pvc.read_only,
                    },
                }
            )
            mounts.append({"name": "model", "mountPath": pvc.mount_path, "readOnly": pvc.read_only})
    elif spec.router.api_key_secret is not None:
        volumes.append(
            {"name": "api-key", "secret": {"secretName": spec.router.api_key_secret.name}}
        )
        mounts.append({"name": "api-key", "mountPath": "/etc/tandem/api-key", "readOnly": True})
    if pool == "router" and spec.model.pvc is not None:
        # The router loads the tokenizer (chat template) from the same model directory.
        pvc = spec.model.pvc
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": pvc.mount_path, "readOnly": True})
    container: dict[str, Any] = {
        "name": pool,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": args,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": config_map_name(owner.name)}}],
        "env": env,
        "readinessProbe": _probe("/health", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
        # Model loading can take minutes on large checkpoints; liveness waits for startup.
        "startupProbe": _probe("/health", period=5, failures=120),
        "resources": _resources(resources),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    if worker is not None:
        # Scale-down drain: the worker leaves the router's registry, refuses new requests and
        # finishes its in-flight ones (a prefill also waits for its pinned KV to be pulled)
        # before Kubernetes sends SIGTERM; bounded by terminationGracePeriodSeconds.
        container["lifecycle"] = {
            "preStop": {"httpGet": {"path": "/v1/internal/drain?timeout=50", "port": "http"}}
        }
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60 if worker is not None else 30,
        "containers": [container],
        "volumes": volumes,
    }
    if worker is not None and worker.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(worker.node_selector.items()))
    if worker is not None and worker.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in worker.tolerations]
    pod_labels = {**common_labels(owner.name, pool), "tandem.dev/metrics": "true"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, child_name(owner.name, pool), pool),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner.name, pool)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: cfg_hash,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(owner: Owner, spec: TandemServiceSpec, pool: str) -> dict[str, Any]:
    """The router gets a normal Service; worker pools get headless ones (per-pod DNS)."""
    port = {"router": spec.router.port, "prefill": spec.prefill.port, "decode": spec.decode.port}
    service_spec: dict[str, Any] = {
        "selector": selector_labels(owner.name, pool),
        "ports": [{"name": "http", "port": port[pool], "targetPort": "http", "protocol": "TCP"}],
    }
    if pool == "router":
        service_spec["type"] = spec.router.service_type
    else:
        service_spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, child_name(owner.name, pool), pool),
        "spec": service_spec,
    }


def render_children(
    owner: Owner, spec: TandemServiceSpec, replicas: Replicas
) -> list[dict[str, Any]]:
    """Every child of one TandemService, in apply order (ConfigMap first, router before pools)."""
    config_map = render_config_map(owner, spec)
    cfg_hash = config_hash(config_map)
    children = [config_map]
    children.append(
        _deployment(
            owner,
            spec,
            "router",
            spec.router.replicas,
            spec.router.port,
            router_args(owner, spec),
            spec.router.resources,
            cfg_hash,
            None,
        )
    )
    for role, pool, count in (
        ("prefill", spec.prefill, replicas.prefill),
        ("decode", spec.decode, replicas.decode),
    ):
        children.append(
            _deployment(
                owner,
                spec,
                role,
                count,
                pool.port,
                worker_args(owner, spec, role),
                pool.resources,
                cfg_hash,
                pool,
            )
        )
    children += [render_service(owner, spec, pool) for pool in POOLS]
    return children
