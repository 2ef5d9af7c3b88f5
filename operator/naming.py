"""Names, labels and ownership of a TandemService's children (pure; shared by rendering).

Every child is named after its TandemService (``<name>-<pool>``, ``<name>-config``,
``<name>-router-internal``, ``<name>-cluster-token``), carries the common labels and one
controller owner reference, so reconciliation finds it and deletion cascades.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import cluster_secret
from tandem.operator.spec import KV_PORT_OFFSETS, TandemServiceSpec

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


# UCX's TCP transport opens its own listening sockets besides the listener; pinning them to a
# range lets the NetworkPolicy admit workers to each other there (and only there).
UCX_TCP_PORT_RANGE = (8300, 8349)


def kv_ports(pool_port: int) -> dict[str, int]:
    """A worker pool's fixed KV listener ports, next to its HTTP port so a NetworkPolicy can
    name every one (manifests/network-policy.yaml): the KV-event publisher (both roles) and,
    on prefill, the KV side channel and the data listener (UCX or TCP)."""
    return {name: pool_port + offset for name, offset in KV_PORT_OFFSETS.items()}


def child_name(owner_name: str, pool: str) -> str:
    return f"{owner_name}-{pool}"


def config_map_name(owner_name: str) -> str:
    return f"{owner_name}-config"


def router_url(owner: Owner, spec: TandemServiceSpec) -> str:
    """The public endpoint (clients, status)."""
    return f"http://{child_name(owner.name, 'router')}.{owner.namespace}.svc:{spec.router.port}"


def internal_service_name(owner_name: str) -> str:
    return f"{owner_name}-router-internal"


def registry_url(owner: Owner, spec: TandemServiceSpec) -> str:
    """Where workers register: the routers' internal port, through a headless Service (one DNS
    record per router pod), never the public one."""
    host = f"{internal_service_name(owner.name)}.{owner.namespace}.svc"
    return f"http://{host}:{spec.router.internal_port}"


def cluster_token_metadata(owner: Owner) -> dict[str, Any]:
    """Metadata of the cluster-token Secret (``cluster_secret.ensure_cluster_token``)."""
    return child_metadata(owner, cluster_secret.secret_name(owner.name), None)


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


def child_metadata(owner: Owner, name: str, pool: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name, pool),
        "ownerReferences": [owner_reference(owner)],
    }
