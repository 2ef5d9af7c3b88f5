"""Render a TandemService's Services (pure): the public router Service, the headless worker
Services (per-pod DNS) and the routers' headless internal Service (registration)."""

from __future__ import annotations

from typing import Any

from tandem.operator.naming import (
    Owner,
    child_metadata,
    child_name,
    internal_service_name,
    selector_labels,
)
from tandem.operator.spec import TandemServiceSpec


def render_internal_service(owner: Owner, spec: TandemServiceSpec) -> dict[str, Any]:
    """Headless (per-pod DNS records) and cluster-internal: workers resolve it to every router
    pod and register with each; the NetworkPolicy admits only workers to this port."""
    port = spec.router.internal_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, internal_service_name(owner.name), "router"),
        "spec": {
            "selector": selector_labels(owner.name, "router"),
            "clusterIP": "None",
            # Registration must not wait for readiness: a starting router still takes it.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "internal", "port": port, "targetPort": "internal", "protocol": "TCP"}
            ],
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
        "metadata": child_metadata(owner, child_name(owner.name, pool), pool),
        "spec": service_spec,
    }
