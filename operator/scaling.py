"""Glue between the spec, the status and the pure autoscaler decision.

Called by the autoscaling step of the resync timer: `policies` and `memory_from_status` turn
the object into the decision's inputs, `autoscaling_status` turns the decisions back into the
status patch, and `effective_replicas` tells the renderer which replica counts to use. Pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from tandem.operator.autoscaler import Decision, Pool, PoolMemory, PoolPolicy
from tandem.operator.children import Replicas
from tandem.operator.spec import TandemServiceSpec


def policies(spec: TandemServiceSpec) -> dict[Pool, PoolPolicy]:
    a = spec.autoscaling
    common = {
        "tolerance": a.tolerance,
        "scale_up_cooldown": float(a.scale_up_cooldown_seconds),
        "scale_down_cooldown": float(a.scale_down_cooldown_seconds),
    }
    return {
        Pool.PREFILL: PoolPolicy(
            min_replicas=a.prefill.min_replicas,
            max_replicas=a.prefill.max_replicas,
            latency_target=a.ttft_seconds,
            kv_usage_target=None,
            per_replica_target=a.prefill_queue_per_replica,
            **common,
        ),
        Pool.DECODE: PoolPolicy(
            min_replicas=a.decode.min_replicas,
            max_replicas=a.decode.max_replicas,
            latency_target=a.itl_seconds,
            kv_usage_target=a.kv_cache_usage,
            per_replica_target=a.decode_running_per_replica,
            **common,
        ),
    }


def to_rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def from_rfc3339(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _pool_status(status: Mapping[str, Any], pool: Pool) -> Mapping[str, Any]:
    autoscaling = status.get("autoscaling") or {}
    entry = autoscaling.get(pool.label) if isinstance(autoscaling, Mapping) else None
    return entry if isinstance(entry, Mapping) else {}


def memory_from_status(status: Mapping[str, Any], pool: Pool) -> PoolMemory:
    entry = _pool_status(status, pool)
    return PoolMemory(
        last_scale_time=from_rfc3339(entry.get("lastScaleTime")),
        slack_since=from_rfc3339(entry.get("slackSince")),
    )


def effective_replicas(spec: TandemServiceSpec, status: Mapping[str, Any]) -> Replicas:
    """Spec replicas, or with autoscaling the autoscaler's last desired count within bounds
    (before its first decision: the planner's starting counts, when the planner is on)."""
    if not spec.autoscaling.enabled:
        return Replicas(prefill=spec.prefill.replicas, decode=spec.decode.replicas)
    counts = {}
    planner = (status.get("autoscaling") or {}).get("planner") or {}
    start = planner.get("startReplicas") if isinstance(planner, Mapping) else None
    for pool, bounds, fallback in (
        (Pool.PREFILL, spec.autoscaling.prefill, spec.prefill.replicas),
        (Pool.DECODE, spec.autoscaling.decode, spec.decode.replicas),
    ):
        if spec.autoscaling.planner and isinstance(start, Mapping):
            planned = start.get(pool.label)
            if not isinstance(planned, bool) and isinstance(planned, int):
                fallback = planned  # the plan for the declared rate, until the first decision
        desired = _pool_status(status, pool).get("desiredReplicas")
        if isinstance(desired, bool) or not isinstance(desired, int):
            desired = fallback
        counts[pool] = bounds.clamp(desired)
    return Replicas(prefill=counts[Pool.PREFILL], decode=counts[Pool.DECODE])


def autoscaling_status(
    decisions: Mapping[Pool, Decision],
    pols: Mapping[Pool, PoolPolicy],
    previous: Mapping[str, Any],
    now: float,
) -> dict[str, Any]:
    """status.autoscaling after one evaluation: per-pool desired count, memory and the latest
    evaluation; lastDecision is the newest decision that changed a count (kept otherwise)."""
    out: dict[str, Any] = {}
    stamp = to_rfc3339(now)
    last = (previous.get("autoscaling") or {}).get("lastDecision")
    for pool, decision in decisions.items():
        record = {**decision.to_status(pols[pool]), "time": stamp}
        out[pool.label] = {
            "desiredReplicas": decision.desired,
            "lastScaleTime": to_rfc3339(decision.memory.last_scale_time),
            "slackSince": to_rfc3339(decision.memory.slack_since),
            "lastEvaluation": record,
        }
        if decision.changed:
            last = record
    out["lastDecision"] = last
    out["lastEvaluationTime"] = stamp
    return out
