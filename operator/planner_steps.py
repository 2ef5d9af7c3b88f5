"""Where the planner enters the reconcile pass and the autoscaling timer (called by handlers.py).

- `start_replicas`: once per TandemService (until status holds them), the plan for the declared
  `spec.workload.requestsPerSecond` becomes the starting replica counts.
- `planned_decisions`: each interval, the plan for the observed rate floors the reactive
  decisions (`planning.apply_floor`), every decision carrying the plan in its message.

Both degrade to the reactive autoscaler alone when the planner cannot answer (no profile,
a failed or timed-out plan), and say why in `status.autoscaling.planner.message`; the caller
posts a Warning Event when that message changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from tandem.operator.autoscaler import Decision, Pool, PoolPolicy, PoolSignals
from tandem.operator.children import Replicas
from tandem.operator.kube import KubeClient
from tandem.operator.planner_client import PlannerClient, interval_floors, query_for, read_profile
from tandem.operator.planning import PlanError, apply_floor, floor_note
from tandem.operator.spec import TandemServiceSpec


@dataclass(slots=True)
class PlannerStep:
    status: dict[str, Any]  # status.autoscaling.planner
    warning: str | None = None  # set when the planner could not answer


def previous_message(status: Mapping[str, Any]) -> str | None:
    block = (status.get("autoscaling") or {}).get("planner") or {}
    return block.get("message") if isinstance(block, Mapping) else None


async def start_replicas(
    planner: PlannerClient, kube: KubeClient, namespace: str, name: str, spec: TandemServiceSpec
) -> PlannerStep:
    """The plan for the declared rate as `startReplicas` (within the autoscaling bounds)."""
    assert spec.workload is not None
    a = spec.autoscaling
    rate = spec.workload.requests_per_second
    try:
        text = await read_profile(kube, namespace, name, spec)
        plan = await planner.plan(text, query_for(spec, rate))
    except PlanError as exc:
        msg = f"planner unavailable, starting from spec replicas: {exc}"
        return PlannerStep({"active": False, "message": msg}, warning=msg)
    start = {
        "prefill": a.prefill.clamp(plan.prefill),
        "decode": a.decode.clamp(plan.decode),
    }
    kind = "" if plan.feasible else " (infeasible: closest miss)"
    return PlannerStep(
        {
            "active": True,
            "startReplicas": start,
            "plan": plan.to_status(),
            "message": f"started from the plan for {rate:g} req/s{kind}",
        }
    )


async def planned_decisions(
    planner: PlannerClient,
    kube: KubeClient,
    namespace: str,
    name: str,
    spec: TandemServiceSpec,
    signals: Mapping[Pool, PoolSignals | None],
    decisions: dict[Pool, Decision],
    policies: Mapping[Pool, PoolPolicy],
    running: Replicas,
    status: Mapping[str, Any],
    now: float,
) -> tuple[dict[Pool, Decision], PlannerStep]:
    """The reactive decisions with the plan's floors applied (unchanged if it cannot answer)."""
    start = ((status.get("autoscaling") or {}).get("planner") or {}).get("startReplicas")
    try:
        text = await read_profile(kube, namespace, name, spec)
        floors = await interval_floors(planner, text, spec, signals, running, status)
    except PlanError as exc:
        msg = f"planner unavailable, reactive rules only: {exc}"
        keep = {"startReplicas": start} if start else {}
        return decisions, PlannerStep({"active": False, "message": msg, **keep}, warning=msg)
    out = dict(decisions)
    for pool, decision in decisions.items():
        if pool not in floors.floors:
            continue
        note = floor_note(
            pool.label, floors.floors[pool], floors.rates[pool], floors.corrections[pool],
            floors.plans[pool],
        )  # fmt: skip
        out[pool] = apply_floor(decision, floors.floors[pool], policies[pool], now, note)
    return out, PlannerStep({"active": True, **floors.status})


def planned_start(status: Mapping[str, Any]) -> bool:
    block = (status.get("autoscaling") or {}).get("planner") or {}
    return isinstance(block, Mapping) and "startReplicas" in block


def planner_event(
    body: Mapping[str, Any], status: Mapping[str, Any], step: PlannerStep, ok_reason: str | None
) -> None:
    """A Warning when the planner's problem is new; ``ok_reason`` (Normal) when it planned."""
    message = step.status.get("message", "")
    if message == previous_message(status):
        return
    if step.warning is not None:
        kopf.event(body, type="Warning", reason="PlannerUnavailable", message=message)
    elif ok_reason is not None:
        kopf.event(body, type="Normal", reason=ok_reason, message=message)
