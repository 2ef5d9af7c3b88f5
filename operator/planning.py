"""The planner's pure half: what to ask `tandem plan`, how to read its answer, and how its
plan becomes a floor under the reactive autoscaler.

The operator imports no other Tandem package, so it runs the one planner there is (the
simulator over the engine's own scheduler, `tandem plan --json`) as a subprocess
(`planner_client.py`) and keeps here only what is pure:

- `PlanQuery.argv`: the command line for a workload, an SLO and the pool bounds;
- `parse_plan`: the answer, validated (a malformed answer is an error, never a floor);
- `rate_bucket`: observed rates rounded up to two significant digits, so a plan is reused
  while the rate wobbles and the subprocess runs only when the traffic really moves;
- `update_correction`: measured / predicted latency, smoothed and bounded, as Dynamo's SLA
  planner corrects its interpolation; learned only while the service runs the planned counts;
- `apply_floor`: a reactive decision raised to the plan's count (reason PlannerFloor).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tandem.operator.autoscaler import Decision, PoolPolicy, Reason

CORRECTION_BOUNDS = (0.5, 4.0)
CORRECTION_WEIGHT = 0.5  # weight of the newest measurement in the moving average
MAX_PLAN_BYTES = 1 << 20


class PlanError(ValueError):
    """The planner could not answer (no profile, a failed run, a malformed answer)."""


@dataclass(frozen=True, slots=True)
class PlanQuery:
    input_tokens: int
    output_tokens: int
    rate: float
    ttft_p90: float
    itl_p90: float
    prefix_share: float
    max_workers: int
    kv_transport: str
    local_prefill_threshold: int
    policy: str
    min_prefill: int = 0

    def argv(self, profile_path: str) -> list[str]:
        """Arguments after `tandem` (the caller adds the interpreter)."""
        return [
            "plan", "--profile", profile_path,
            "--isl", str(self.input_tokens), "--osl", str(self.output_tokens),
            "--rate", repr(self.rate), "--ttft-p90", repr(self.ttft_p90),
            "--itl-p90", repr(self.itl_p90), "--prefix-share", repr(self.prefix_share),
            "--max-workers", str(self.max_workers), "--kv-transport", self.kv_transport,
            "--local-prefill-threshold", str(self.local_prefill_threshold),
            "--policy", self.policy, "--min-prefill", str(self.min_prefill),
            # The autoscaler's own signals are the router's histograms: plan in that view.
            "--slo-view", "router", "--json",
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class PlanAnswer:
    prefill: int
    decode: int
    feasible: bool
    ttft_p90: float | None  # predicted for the planned counts
    itl_p90: float | None

    def to_status(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "feasible": self.feasible,
            "predictedTtftP90Seconds": self.ttft_p90,
            "predictedItlP90Seconds": self.itl_p90,
        }


def _count(body: Mapping[str, Any], key: str, minimum: int) -> int:
    v = body.get(key)
    if type(v) is not int or not minimum <= v <= 4096:
        raise PlanError(f"plan answer: {key} must be an integer in [{minimum}, 4096], got {v!r}")
    return v


def _seconds(pred: Mapping[str, Any], key: str) -> float | None:
    v = pred.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise PlanError(f"plan answer: predicted.{key} must be seconds or null, got {v!r}")
    return float(v)


def parse_plan(text: str) -> PlanAnswer:
    """`tandem plan --json` output -> PlanAnswer; PlanError for anything else."""
    if len(text) > MAX_PLAN_BYTES:
        raise PlanError("plan answer is too large")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan answer is not JSON: {exc}") from None
    if not isinstance(body, Mapping) or not isinstance(body.get("predicted"), Mapping):
        raise PlanError("plan answer must be an object with 'predicted'")
    if not isinstance(body.get("feasible"), bool):
        raise PlanError("plan answer: feasible must be a boolean")
    pred = body["predicted"]
    return PlanAnswer(
        prefill=_count(body, "prefill", 0),
        decode=_count(body, "decode", 1),
        feasible=body["feasible"],
        ttft_p90=_seconds(pred, "ttft_p90"),
        itl_p90=_seconds(pred, "itl_p90"),
    )


def rate_bucket(rate: float) -> float:
    """Round up to two significant digits (0.0123 -> 0.013, 4.21 -> 4.3, 118 -> 120)."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"a rate to plan for must be > 0, got {rate!r}")
    step = 10.0 ** (math.floor(math.log10(rate)) - 1)
    return round(math.ceil(rate / step - 1e-9) * step, 12)


def update_correction(previous: float, measured: float | None, predicted: float | None) -> float:
    """Blend measured/predicted latency into the correction factor, bounded to [0.5, 4]."""
    if measured is None or predicted is None or predicted <= 0 or not math.isfinite(measured):
        return previous
    lo, hi = CORRECTION_BOUNDS
    ratio = min(hi, max(lo, measured / predicted))
    blended = (1 - CORRECTION_WEIGHT) * previous + CORRECTION_WEIGHT * ratio
    return round(min(hi, max(lo, blended)), 6)


def apply_floor(
    decision: Decision, floor: int, policy: PoolPolicy, now: float, note: str
) -> Decision:
    """The reactive decision, or the plan's count when that is higher (within bounds).

    A floor above the current count scales up at once: the plan says this traffic needs it,
    and waiting for latency to degrade first is what planning avoids. Cooldowns still pace the
    reactive rules; scale-down never goes below the floor.
    """
    floor = max(policy.min_replicas, min(policy.max_replicas, floor))
    if decision.desired >= floor:
        return replace(decision, note=note)
    memory = decision.memory
    if floor != decision.current:
        memory = replace(memory, last_scale_time=now, slack_since=None)
    return replace(decision, desired=floor, reason=Reason.PLANNER_FLOOR, memory=memory, note=note)


def floor_note(pool: str, floor: int, rate: float, correction: float, plan: PlanAnswer) -> str:
    kind = f"{plan.prefill}P{plan.decode}D" if plan.prefill else f"{plan.decode} colocated"
    feasible = "" if plan.feasible else ", infeasible: closest miss"
    return (
        f"plan for {rate:g} req/s (x{correction:g} correction) is {kind}{feasible}; "
        f"{pool} floor {floor}"
    )
