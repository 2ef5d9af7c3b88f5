"""The autoscaler's decision: a pure function from observed signals to a replica count.

Called by the autoscaling timer once per interval and per pool. The timer gathers the signals
(see tandem.operator.signals), keeps `PoolMemory` in the TandemService's status between calls,
and applies the returned `Decision`; nothing here does I/O or reads a clock.

The rules, in order:
1. A count outside [min, max] is clamped at once (the user changed the bounds).
2. No signals: hold. Zero traffic, sustained for the scale-down cooldown: go to min.
3. Load ratio r = the largest of (latency p90 / SLO target) and the pool's load ratios (prefill:
   waiting per warm replica vs the queue target; decode: KV usage vs its target and running per
   warm replica vs its target). Only warm pods' samples count; pods still warming up and pods
   not yet ready are capacity that is coming.
4. r > 1 + tolerance: scale up to ceil(warm * r), unless that capacity is already coming or the
   pool scaled within the scale-up cooldown.
5. r < 1 - tolerance, sustained for the scale-down cooldown: scale down to the fewest replicas
   n for which the survivors stay below 1 - tolerance (r * N / n), so one less replica is
   allowed only when r * N / (N - 1) fits; otherwise hold.
6. Anything between the two thresholds holds (hysteresis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any


class Pool(IntEnum):
    PREFILL = 1
    DECODE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Reason(IntEnum):
    """Why a decision was taken; `.camel` is what status and Events carry."""

    CLAMPED_TO_BOUNDS = 1
    NO_METRICS = 2
    IDLE_AT_MIN = 3
    SCALE_TO_MIN_IDLE = 4
    WARMING_UP = 5
    SCALE_UP_LATENCY = 6
    SCALE_UP_QUEUE = 7
    SCALE_UP_KV_CACHE = 8
    SCALE_UP_RUNNING = 9
    CAPACITY_PENDING = 10
    AT_MAX = 11
    COOLDOWN = 12
    WITHIN_TOLERANCE = 13
    SLACK_NOT_SUSTAINED = 14
    AT_MIN = 15
    SURVIVORS_WOULD_OVERLOAD = 16
    SCALE_DOWN_SLACK = 17
    # The planner's count for the observed rate is above the reactive decision (planning.py).
    PLANNER_FLOOR = 18

    @property
    def camel(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))


class Signal(IntEnum):
    """Which measurement produced the load ratio."""

    LATENCY = 1
    QUEUE = 2
    KV_CACHE = 3
    RUNNING = 4


_UP_REASON = {
    Signal.LATENCY: Reason.SCALE_UP_LATENCY,
    Signal.QUEUE: Reason.SCALE_UP_QUEUE,
    Signal.KV_CACHE: Reason.SCALE_UP_KV_CACHE,
    Signal.RUNNING: Reason.SCALE_UP_RUNNING,
}


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One interval's measurements for one pool, from warm pods only.

    latency_p90: TTFT p90 (prefill) or ITL p90 (decode) in seconds, measured by the router from
    request arrival (so it includes queueing); None when no request completed in the window.
    waiting/running: summed over warm pods. kv_usage: mean over warm pods (0..1), None if unknown.
    arrivals: requests per second reaching the router; throughput: tokens per second the pool
    processed (prompt tokens for prefill, generated tokens for decode).
    """

    latency_p90: float | None
    waiting: float
    running: float
    kv_usage: float | None
    arrivals: float
    throughput: float
    warm_replicas: int

    @property
    def idle(self) -> bool:
        return (
            self.arrivals == 0 and self.waiting == 0 and self.running == 0 and self.throughput == 0
        )


@dataclass(frozen=True, slots=True)
class PoolState:
    """The pool's Deployment now: `current` is its spec.replicas, `ready` its ready replicas."""

    current: int
    ready: int


@dataclass(frozen=True, slots=True)
class PoolMemory:
    """What the autoscaler remembers between intervals (kept in status; epoch seconds)."""

    last_scale_time: float | None = None
    slack_since: float | None = None


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    min_replicas: int
    max_replicas: int
    latency_target: float
    kv_usage_target: float | None
    per_replica_target: float
    tolerance: float
    scale_up_cooldown: float
    scale_down_cooldown: float


@dataclass(frozen=True, slots=True)
class Decision:
    pool: Pool
    current: int
    desired: int
    reason: Reason
    ratio: float | None
    signal: Signal | None
    signals: PoolSignals | None
    memory: PoolMemory
    note: str | None = None  # the planner's floor, when it was consulted

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def message(self, policy: PoolPolicy) -> str:
        what = f"{self.pool.label}: {self.current} -> {self.desired} ({self.reason.camel})"
        if self.ratio is not None and self.signal is not None:
            what += f"; load ratio {self.ratio:.2f} from {self.signal.name.lower()}"
        if self.signals is not None and self.signals.latency_p90 is not None:
            what += f"; p90 {self.signals.latency_p90:.4f}s vs target {policy.latency_target}s"
        if self.note:
            what += f"; {self.note}"
        return what

    def to_status(self, policy: PoolPolicy) -> dict[str, Any]:
        """The numbers that drove the decision, for status.autoscaling.lastDecision."""
        out: dict[str, Any] = {
            "pool": self.pool.label,
            "from": self.current,
            "to": self.desired,
            "reason": self.reason.camel,
            "message": self.message(policy),
            "loadRatio": None if self.ratio is None else round(self.ratio, 4),
            "signal": None if self.signal is None else self.signal.name.lower(),
            "latencyTargetSeconds": policy.latency_target,
        }
        out["metrics"] = None
        if self.signals is not None:
            s = self.signals
            out["metrics"] = {
                "latencyP90Seconds": s.latency_p90,
                "waiting": s.waiting,
                "running": s.running,
                "kvCacheUsage": s.kv_usage,
                "arrivalsPerSecond": round(s.arrivals, 4),
                "tokensPerSecond": round(s.throughput, 4),
                "warmReplicas": s.warm_replicas,
            }
        return out


def load_ratio(pool: Pool, signals: PoolSignals, policy: PoolPolicy) -> tuple[float, Signal | None]:
    """The largest of the pool's demand-to-target ratios and which signal it came from."""
    candidates: list[tuple[float, Signal]] = []
    if signals.latency_p90 is not None:
        candidates.append((signals.latency_p90 / policy.latency_target, Signal.LATENCY))
    warm = max(signals.warm_replicas, 1)
    if pool is Pool.PREFILL:
        candidates.append((signals.waiting / warm / policy.per_replica_target, Signal.QUEUE))
    else:
        candidates.append((signals.running / warm / policy.per_replica_target, Signal.RUNNING))
        if signals.kv_usage is not None and policy.kv_usage_target:
            candidates.append((signals.kv_usage / policy.kv_usage_target, Signal.KV_CACHE))
    if not candidates:
        return 0.0, None
    return max(candidates, key=lambda c: c[0])


def decide(
    pool: Pool,
    state: PoolState,
    signals: PoolSignals | None,
    memory: PoolMemory,
    policy: PoolPolicy,
    now: float,
) -> Decision:
    """Desired replicas for one pool at time `now` (epoch seconds); see the module docstring."""
    current = state.current

    def result(
        desired: int,
        reason: Reason,
        mem: PoolMemory,
        ratio: float | None = None,
        signal: Signal | None = None,
    ) -> Decision:
        if desired != current:
            mem = replace(mem, last_scale_time=now, slack_since=None)
        return Decision(pool, current, desired, reason, ratio, signal, signals, mem)

    clamped = max(policy.min_replicas, min(policy.max_replicas, current))
    if clamped != current:
        return result(clamped, Reason.CLAMPED_TO_BOUNDS, memory)
    if signals is None:
        return result(current, Reason.NO_METRICS, memory)

    def since(t: float | None) -> float:
        return math.inf if t is None else now - t

    if signals.idle:
        slack = memory if memory.slack_since is not None else replace(memory, slack_since=now)
        if current <= policy.min_replicas:
            return result(current, Reason.IDLE_AT_MIN, slack)
        if since(slack.slack_since) < policy.scale_down_cooldown:
            return result(current, Reason.SLACK_NOT_SUSTAINED, slack)
        if since(memory.last_scale_time) < policy.scale_down_cooldown:
            return result(current, Reason.COOLDOWN, slack)
        return result(policy.min_replicas, Reason.SCALE_TO_MIN_IDLE, slack)

    ratio, signal = load_ratio(pool, signals, policy)
    warm = signals.warm_replicas
    busy = replace(memory, slack_since=None)
    if ratio > 1 + policy.tolerance:
        if current >= policy.max_replicas:
            return result(current, Reason.AT_MAX, busy, ratio, signal)
        if warm == 0 and current > 0:
            return result(current, Reason.WARMING_UP, busy, ratio, signal)
        needed = max(1, math.ceil(warm * ratio - 1e-9))
        if needed <= current:
            # Pods that are pending or still warming up will absorb this load.
            return result(current, Reason.CAPACITY_PENDING, busy, ratio, signal)
        if since(memory.last_scale_time) < policy.scale_up_cooldown:
            return result(current, Reason.COOLDOWN, busy, ratio, signal)
        desired = min(policy.max_replicas, needed)
        return result(desired, _UP_REASON[signal or Signal.LATENCY], busy, ratio, signal)

    if ratio < 1 - policy.tolerance:
        slack = memory if memory.slack_since is not None else replace(memory, slack_since=now)
        if current <= policy.min_replicas:
            return result(current, Reason.AT_MIN, slack, ratio, signal)
        if warm < current or state.ready < current:
            return result(current, Reason.CAPACITY_PENDING, slack, ratio, signal)
        if since(slack.slack_since) < policy.scale_down_cooldown:
            return result(current, Reason.SLACK_NOT_SUSTAINED, slack, ratio, signal)
        if since(memory.last_scale_time) < policy.scale_down_cooldown:
            return result(current, Reason.COOLDOWN, slack, ratio, signal)
        # Survivors take N/n of today's load each and must stay under the lower threshold.
        fewest = math.ceil(ratio * current / (1 - policy.tolerance) - 1e-9)
        desired = max(policy.min_replicas, fewest, 1)
        if desired >= current:
            return result(current, Reason.SURVIVORS_WOULD_OVERLOAD, slack, ratio, signal)
        return result(desired, Reason.SCALE_DOWN_SLACK, slack, ratio, signal)

    return result(current, Reason.WITHIN_TOLERANCE, busy, ratio, signal)
