"""TandemService status: conditions, per-pool replicas and the endpoint, computed purely.

Called by the reconciler after each pass with what it read back from the pool Deployments;
the result is merge-patched into the status subresource. Condition timestamps move only when a
condition's status changes, so repeated passes write identical conditions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tandem.operator.reconcile import PoolStatus


class ConditionType(IntEnum):
    READY = 1
    PROGRESSING = 2
    DEGRADED = 3
    METRICS_AVAILABLE = 4  # owned by the autoscaler: its metrics source answers sanely

    @property
    def label(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))


_RECONCILER_CONDITIONS = frozenset(
    t.label for t in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED)
)


class DegradedReason(IntEnum):
    INVALID_SPEC = 1
    CHILD_CONFLICT = 2
    APPLY_FAILED = 3
    CLUSTER_TOKEN = 4  # the cluster-token Secret is missing, foreign or unusable

    @property
    def camel(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))


@dataclass(frozen=True, slots=True)
class Problem:
    reason: DegradedReason
    message: str


@dataclass(frozen=True, slots=True)
class Condition:
    type: ConditionType
    status: bool
    reason: str
    message: str

    def to_dict(self, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
        status = "True" if self.status else "False"
        unchanged = previous is not None and previous.get("status") == status
        return {
            "type": self.type.label,
            "status": status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": (previous or {}).get("lastTransitionTime", now)
            if unchanged
            else now,
        }


def _ready_text(pool: PoolStatus | None) -> str:
    return "0/0" if pool is None else f"{pool.ready}/{pool.replicas}"


def conditions_for(
    pools: Mapping[str, PoolStatus | None], problem: Problem | None
) -> list[Condition]:
    """Ready: the router and decode can serve (prefill is optional: decode prefills locally).
    Progressing: some pool is not yet at its desired, updated, ready count.
    Degraded: the spec or a child could not be applied (children are left as they were)."""
    missing = [name for name, p in pools.items() if p is None]
    unready = [
        name
        for name in ("router", "decode")
        if (p := pools.get(name)) is None or p.ready < 1 or p.available < 1
    ]
    if missing:
        ready = Condition(
            ConditionType.READY, False, "ChildrenMissing", "missing: " + ", ".join(missing)
        )
    elif unready:
        ready = Condition(
            ConditionType.READY,
            False,
            "MinimumReplicasUnavailable",
            "no ready replica in: " + ", ".join(unready),
        )
    else:
        summary = ", ".join(f"{n} {_ready_text(p)}" for n, p in pools.items())
        ready = Condition(ConditionType.READY, True, "Serving", summary)
    rolling = [
        name
        for name, p in pools.items()
        if p is not None
        and (not p.observed_current or p.updated < p.replicas or p.ready != p.replicas)
    ]
    if missing:
        progressing = Condition(ConditionType.PROGRESSING, True, "Creating", "creating children")
    elif rolling:
        progressing = Condition(
            ConditionType.PROGRESSING,
            True,
            "RollingOut",
            "; ".join(f"{n} {_ready_text(pools[n])} ready" for n in rolling),
        )
    else:
        progressing = Condition(
            ConditionType.PROGRESSING, False, "Complete", "all pools at their desired replicas"
        )
    if problem is None:
        degraded = Condition(ConditionType.DEGRADED, False, "AsExpected", "")
    else:
        degraded = Condition(ConditionType.DEGRADED, True, problem.reason.camel, problem.message)
    return [ready, progressing, degraded]


def build_status(
    generation: int | None,
    pools: Mapping[str, PoolStatus | None],
    endpoint: str | None,
    problem: Problem | None,
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The status patch (everything but `autoscaling`, which the autoscaler owns).

    observedGeneration advances only when the generation was applied without a problem.
    """
    previous = {c.get("type"): c for c in previous_conditions if isinstance(c, Mapping)}
    conditions = [
        c.to_dict(previous.get(c.type.label), now) for c in conditions_for(pools, problem)
    ]
    # Conditions other owners keep (the autoscaler's MetricsAvailable) pass through unchanged.
    conditions += [
        dict(c)
        for t, c in previous.items()
        if isinstance(t, str) and t not in _RECONCILER_CONDITIONS
    ]
    status: dict[str, Any] = {"conditions": conditions}
    if problem is None and generation is not None:
        status["observedGeneration"] = generation
    for name, pool in pools.items():
        status[name] = {
            "replicas": 0 if pool is None else pool.replicas,
            "readyReplicas": 0 if pool is None else pool.ready,
            "ready": _ready_text(pool),
        }
    if endpoint is not None:
        status["endpoint"] = endpoint
    return status


def with_metrics_condition(
    previous_conditions: Sequence[Mapping[str, Any]], error: str | None, now: str
) -> list[dict[str, Any]]:
    """The conditions list with the autoscaler's MetricsAvailable set from its last collect
    (``error`` None: the source answered)."""
    label = ConditionType.METRICS_AVAILABLE.label
    kept = [dict(c) for c in previous_conditions if isinstance(c, Mapping)]
    previous = next((c for c in kept if c.get("type") == label), None)
    condition = Condition(
        ConditionType.METRICS_AVAILABLE,
        error is None,
        "Answering" if error is None else "MetricsUnavailable",
        error or "",
    )
    return [c for c in kept if c.get("type") != label] + [condition.to_dict(previous, now)]
