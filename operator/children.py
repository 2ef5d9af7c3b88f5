"""Render a TandemService's children (Deployments, Services, ConfigMap) as pure functions.

Called by the reconciler on every create/update/resume/timer pass; the same spec and replica
counts always give the same manifests, which is what makes reconciliation idempotent. The
reconciler owns the API calls; nothing here touches the network.

The cluster token is the one child that is not a function of the spec: the reconciler creates
its Secret once with a random token (``cluster_secret.ensure_cluster_token``) and never
rewrites it.
Every pod mounts that Secret and reads the token from the file; no rendered spec holds it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tandem.operator import cluster_secret
from tandem.operator.naming import (
    CONFIG_HASH_ANNOTATION,
    POOLS,
    RUN_AS_USER,
    UCX_TCP_PORT_RANGE,
    Owner,
    child_metadata,
    child_name,
    common_labels,
    config_map_name,
    kv_ports,
    registry_url,
    router_url,
    selector_labels,
)
from tandem.operator.services import render_internal_service, render_service
from tandem.operator.spec import PoolSpec, Resources, TandemServiceSpec


@dataclass(frozen=True, slots=True)
class Replicas:
    """Worker replica counts to render: spec values, or the autoscaler's decisions."""

    prefill: int
    decode: int


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
        "UCX_TCP_PORT_RANGE": "{}-{}".format(*UCX_TCP_PORT_RANGE),
        "PYTHONUNBUFFERED": "1",
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, config_map_name(owner.name), None),
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
        "--internal-port",
        str(spec.router.internal_port),
        "--cluster-token-file",
        cluster_secret.TOKEN_PATH,
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
        registry_url(owner, spec),
        "--cluster-token-file",
        cluster_secret.TOKEN_PATH,
        "--kv-transport",
        spec.kv_transport,
    ]
    kv = kv_ports(pool.port)
    args += ["--kv-events-port", str(kv["kv-events"])]
    if role == "prefill":
        args += ["--kv-side-channel-port", str(kv["kv-side"]), "--kv-data-port", str(kv["kv-data"])]
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
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {
            "name": "cluster-token",
            "secret": {
                "secretName": cluster_secret.secret_name(owner.name),
                "defaultMode": 0o440,  # owner and group (fsGroup): the pod's user only
            },
        },
    ]
    # Not a subPath mount: a rotated Secret reaches the running pod, which re-reads the file.
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cluster-token", "mountPath": cluster_secret.TOKEN_DIR, "readOnly": True},
    ]
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
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    if pool == "router":
        ports.append(
            {"name": "internal", "containerPort": spec.router.internal_port, "protocol": "TCP"}
        )
    else:
        kv = kv_ports(port)
        names = ("kv-events", "kv-side", "kv-data") if pool == "prefill" else ("kv-events",)
        ports += [{"name": n, "containerPort": kv[n], "protocol": "TCP"} for n in names]
    container: dict[str, Any] = {
        "name": pool,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": args,
        "ports": ports,
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
        # before Kubernetes sends SIGTERM; bounded by terminationGracePeriodSeconds. The drain
        # route needs the cluster token, which an httpGet hook cannot send: `tandem drain`
        # reads it from the mounted file.
        container["lifecycle"] = {
            "preStop": {
                "exec": {
                    "command": [
                        "tandem",
                        "drain",
                        "--port",
                        str(port),
                        "--timeout",
                        "50",
                        "--cluster-token-file",
                        cluster_secret.TOKEN_PATH,
                    ]  # fmt: skip
                }
            }
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
        "metadata": child_metadata(owner, child_name(owner.name, pool), pool),
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
    children.append(render_internal_service(owner, spec))
    return children
