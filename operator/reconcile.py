"""Bring the live children of a TandemService to the rendered ones, and read their state.

Called by the handlers (create/update/resume, the resync timer, child events) with the client
the operator owns. Idempotent: a child that already matches its rendering is not written, so
re-running changes nothing; a child that was edited or deleted is patched or recreated.

Each child carries the JSON of what was last applied in an annotation (as `kubectl apply`
does), so a field the operator stops rendering is removed by a merge patch, and fields other
controllers or the API server add (defaults, status) are left alone.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tandem.operator.kube import KubeAPIError, KubeClient, object_path
from tandem.operator.naming import POOL_LABEL, SERVICE_LABEL, Owner, child_name
from tandem.operator.signals import PodInfo
from tandem.operator.spec import TandemServiceSpec

LAST_APPLIED = "tandem.dev/last-applied"


class Action(IntEnum):
    UNCHANGED = 0
    CREATED = 1
    UPDATED = 2


class ChildConflictError(RuntimeError):
    """A child's name is taken by an object another controller owns."""


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """A pool Deployment's replica counts as its controller last reported them."""

    replicas: int
    ready: int
    updated: int
    available: int
    observed_current: bool  # the Deployment controller has seen its latest generation


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (lists element-wise)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, lv) for d, lv in zip(desired, live, strict=True))
        )
    return desired == live


def removal_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` as a merge patch that also nulls the keys `old` had and `new` dropped."""
    out: dict[str, Any] = {}
    for key in old:
        if key not in new:
            out[key] = None
    for key, value in new.items():
        previous = old.get(key)
        if isinstance(value, Mapping) and isinstance(previous, Mapping):
            out[key] = removal_patch(previous, value)
        else:
            out[key] = value
    return out


def annotate_last_applied(desired: Mapping[str, Any]) -> dict[str, Any]:
    text = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    meta = dict(desired["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), LAST_APPLIED: text}
    return {**desired, "metadata": meta}


def child_patch(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes `live` match `desired`, or None if it already does."""
    annotated = annotate_last_applied(desired)
    if is_subset(annotated, live):
        return None
    raw = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    try:
        previous = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        previous = {}
    if not isinstance(previous, Mapping):
        previous = {}
    patch = removal_patch(previous, annotated)
    # Identity fields are not patched (and apiVersion/kind are in the URL).
    patch.pop("apiVersion", None)
    patch.pop("kind", None)
    return patch


def drifted(live: Mapping[str, Any]) -> bool:
    """Whether a child no longer matches what the operator last applied to it."""
    raw = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    try:
        applied = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        applied = None
    if not isinstance(applied, Mapping) or "metadata" not in applied:
        return True
    return child_patch(applied, live) is not None


def _check_owner(live: Mapping[str, Any], owner: Owner) -> None:
    for ref in live.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid") != owner.uid:
            name = live.get("metadata", {}).get("name")
            raise ChildConflictError(
                f"{live.get('kind')} {name} is controlled by {ref.get('kind')} "
                f"{ref.get('name')}; rename or delete it"
            )


async def apply_child(
    client: KubeClient, owner: Owner, desired: Mapping[str, Any]
) -> tuple[Action, dict[str, Any]]:
    """Create or patch one child so it matches `desired`; returns what the server holds now."""
    meta = desired["metadata"]
    kind, api_version = desired["kind"], desired["apiVersion"]
    path = object_path(api_version, kind, meta["namespace"], meta["name"])
    live = await client.get(path)
    if live is None:
        try:
            created = await client.create(
                object_path(api_version, kind, meta["namespace"]), annotate_last_applied(desired)
            )
            return Action.CREATED, created
        except KubeAPIError as exc:
            if exc.status != 409:
                raise
            # Created concurrently (another pass of this reconcile); fall through to patch.
            live = await client.get(path)
            if live is None:
                raise
    _check_owner(live, owner)
    patch = child_patch(desired, live)
    if patch is None:
        return Action.UNCHANGED, live
    return Action.UPDATED, await client.merge_patch(path, patch)


async def apply_children(
    client: KubeClient, owner: Owner, children: Sequence[Mapping[str, Any]]
) -> dict[str, tuple[Action, dict[str, Any]]]:
    """Apply all children in order; keys are "Kind/name", values the action and the object."""
    applied: dict[str, tuple[Action, dict[str, Any]]] = {}
    for child in children:
        key = f"{child['kind']}/{child['metadata']['name']}"
        applied[key] = await apply_child(client, owner, child)
    return applied


def pools_from(
    owner: Owner, applied: Mapping[str, tuple[Action, Mapping[str, Any]]]
) -> dict[str, PoolStatus | None]:
    """Pool status from the Deployments an apply pass just read or wrote (saves re-reading)."""
    out: dict[str, PoolStatus | None] = {}
    for pool in ("router", "prefill", "decode"):
        entry = applied.get(f"Deployment/{child_name(owner.name, pool)}")
        out[pool] = None if entry is None else pool_status_from(entry[1])
    return out


def _owned(obj: Mapping[str, Any], owner: Owner) -> bool:
    return any(
        ref.get("uid") == owner.uid for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


async def delete_children(client: KubeClient, owner: Owner) -> list[str]:
    """Delete what this TandemService owns (the garbage collector would, too; this makes
    deletion complete where there is none, and fast where there is)."""
    deleted: list[str] = []
    selector = f"{SERVICE_LABEL}={owner.name}"
    for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap")):
        for obj in await client.list(object_path(api_version, kind, owner.namespace), selector):
            if not _owned(obj, owner):
                continue
            name = obj["metadata"]["name"]
            if await client.delete(object_path(api_version, kind, owner.namespace, name)):
                deleted.append(f"{kind}/{name}")
    return deleted


def pool_status_from(deployment: Mapping[str, Any] | None) -> PoolStatus | None:
    if deployment is None:
        return None
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    return PoolStatus(
        replicas=int(spec.get("replicas", 1)),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        observed_current=generation is None or observed == generation,
    )


async def read_pools(client: KubeClient, owner: Owner) -> dict[str, PoolStatus | None]:
    out: dict[str, PoolStatus | None] = {}
    for pool in ("router", "prefill", "decode"):
        path = object_path("apps/v1", "Deployment", owner.namespace, child_name(owner.name, pool))
        out[pool] = pool_status_from(await client.get(path))
    return out


def _parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def pod_info(pod: Mapping[str, Any], spec: TandemServiceSpec, now: datetime.datetime) -> PodInfo:
    """What the autoscaler needs of a pod: pool, address, readiness and time since Ready."""
    meta = pod.get("metadata", {})
    status = pod.get("status") or {}
    pool = (meta.get("labels") or {}).get(POOL_LABEL, "")
    ports = {"router": spec.router.port, "prefill": spec.prefill.port, "decode": spec.decode.port}
    ready, since = False, None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            ready = cond.get("status") == "True"
            since = _parse_time(cond.get("lastTransitionTime"))
    deleting = bool(meta.get("deletionTimestamp"))
    ready_seconds = (now - since).total_seconds() if ready and since is not None else 0.0
    return PodInfo(
        name=meta.get("name", ""),
        pool=pool,
        ip=status.get("podIP"),
        port=ports.get(pool, 0),
        ready=ready and not deleting,
        ready_seconds=max(ready_seconds, 0.0),
    )


async def list_pods(
    client: KubeClient, owner: Owner, spec: TandemServiceSpec, now: datetime.datetime
) -> list[PodInfo]:
    pods = await client.list(
        object_path("v1", "Pod", owner.namespace), f"{SERVICE_LABEL}={owner.name}"
    )
    return [pod_info(p, spec, now) for p in pods]
