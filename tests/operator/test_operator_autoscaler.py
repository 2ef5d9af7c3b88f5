"""Decision table for the pure autoscaler (tandem.operator.autoscaler.decide)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tandem.operator.autoscaler import (
    Pool,
    PoolMemory,
    PoolPolicy,
    PoolSignals,
    PoolState,
    Reason,
    Signal,
    decide,
    load_ratio,
)

NOW = 10_000.0

PREFILL = PoolPolicy(
    min_replicas=1,
    max_replicas=6,
    latency_target=1.0,  # TTFT p90 seconds
    kv_usage_target=None,
    per_replica_target=4.0,  # waiting per replica
    tolerance=0.1,
    scale_up_cooldown=30.0,
    scale_down_cooldown=120.0,
)
DECODE = PoolPolicy(
    min_replicas=1,
    max_replicas=6,
    latency_target=0.05,  # ITL p90 seconds
    kv_usage_target=0.8,
    per_replica_target=32.0,  # running per replica
    tolerance=0.1,
    scale_up_cooldown=30.0,
    scale_down_cooldown=120.0,
)


def sig(
    latency: float | None = 0.5,
    waiting: float = 0,
    running: float = 1,
    kv: float | None = None,
    arrivals: float = 1.0,
    throughput: float = 100.0,
    warm: int = 2,
) -> PoolSignals:
    return PoolSignals(latency, waiting, running, kv, arrivals, throughput, warm)


IDLE = sig(latency=None, waiting=0, running=0, kv=0.0, arrivals=0, throughput=0)
LONG_AGO = NOW - 1000
SLACK_LONG = PoolMemory(last_scale_time=LONG_AGO, slack_since=LONG_AGO)


@dataclass(frozen=True)
class Case:
    name: str
    pool: Pool
    current: int
    ready: int
    signals: PoolSignals | None
    memory: PoolMemory
    desired: int
    reason: Reason
    policy: PoolPolicy | None = None


CASES = [
    # Scale up on the SLO: TTFT p90 2.5x target with 2 warm replicas -> ceil(2 * 2.5) = 5.
    Case(
        "prefill up on ttft",
        Pool.PREFILL,
        2,
        2,
        sig(latency=2.5),
        PoolMemory(),
        5,
        Reason.SCALE_UP_LATENCY,
    ),
    # Queueing is seen even before latency moves: 20 waiting on 2 replicas vs 4 each -> 2.5.
    Case(
        "prefill up on queue",
        Pool.PREFILL,
        2,
        2,
        sig(latency=0.5, waiting=20),
        PoolMemory(),
        5,
        Reason.SCALE_UP_QUEUE,
    ),
    # ITL p90 0.08 vs 0.05 -> 1.6, 3 warm -> ceil(4.8) = 5.
    Case(
        "decode up on itl",
        Pool.DECODE,
        3,
        3,
        sig(latency=0.08, warm=3),
        PoolMemory(),
        5,
        Reason.SCALE_UP_LATENCY,
    ),
    Case(
        "decode up on kv",
        Pool.DECODE,
        2,
        2,
        sig(latency=0.03, kv=0.96),
        PoolMemory(),
        3,
        Reason.SCALE_UP_KV_CACHE,
    ),
    Case(
        "decode up on running",
        Pool.DECODE,
        2,
        2,
        sig(latency=0.03, running=96),
        PoolMemory(),
        3,
        Reason.SCALE_UP_RUNNING,
    ),
    # Clamp to max.
    Case(
        "up clamped to max",
        Pool.PREFILL,
        4,
        4,
        sig(latency=10.0, warm=4),
        PoolMemory(),
        6,
        Reason.SCALE_UP_LATENCY,
    ),
    Case(
        "hold at max", Pool.PREFILL, 6, 6, sig(latency=10.0, warm=6), PoolMemory(), 6, Reason.AT_MAX
    ),
    # Hysteresis: 1.05 is inside [0.9, 1.1].
    Case(
        "hold inside band (up side)",
        Pool.PREFILL,
        2,
        2,
        sig(latency=1.05),
        SLACK_LONG,
        2,
        Reason.WITHIN_TOLERANCE,
    ),
    Case(
        "hold inside band (down side)",
        Pool.DECODE,
        2,
        2,
        sig(latency=0.046),
        SLACK_LONG,
        2,
        Reason.WITHIN_TOLERANCE,
    ),
    # Cooldown after a recent scale.
    Case(
        "up blocked by cooldown",
        Pool.PREFILL,
        2,
        2,
        sig(latency=2.0),
        PoolMemory(last_scale_time=NOW - 10),
        2,
        Reason.COOLDOWN,
    ),
    Case(
        "up after cooldown",
        Pool.PREFILL,
        2,
        2,
        sig(latency=2.0),
        PoolMemory(last_scale_time=NOW - 31),
        4,
        Reason.SCALE_UP_LATENCY,
    ),
    # Pending pods count as capacity: 4 desired, 2 ready+warm, need ceil(2 * 1.5) = 3 <= 4.
    Case(
        "pending pods absorb",
        Pool.PREFILL,
        4,
        2,
        sig(latency=1.5, warm=2),
        PoolMemory(),
        4,
        Reason.CAPACITY_PENDING,
    ),
    # ... but not when the need exceeds what is coming: ceil(2 * 3.0) = 6 > 4.
    Case(
        "pending pods not enough",
        Pool.PREFILL,
        4,
        2,
        sig(latency=3.0, warm=2),
        PoolMemory(),
        6,
        Reason.SCALE_UP_LATENCY,
    ),
    # Warm-up discounting: ready pods still warming up are not sampled and count as coming.
    Case(
        "all warming up",
        Pool.DECODE,
        2,
        2,
        sig(latency=0.2, warm=0),
        PoolMemory(),
        2,
        Reason.WARMING_UP,
    ),
    Case(
        "warming pods absorb",
        Pool.DECODE,
        3,
        3,
        sig(latency=0.06, warm=1),
        PoolMemory(),
        3,
        Reason.CAPACITY_PENDING,
    ),
    # Scale down on sustained slack; survivors must fit under 1 - tolerance.
    # 4 replicas at ratio 0.3: fewest n with 0.3 * 4 / n <= 0.9 -> n = 2.
    Case(
        "down on sustained slack",
        Pool.PREFILL,
        4,
        4,
        sig(latency=0.3, warm=4),
        SLACK_LONG,
        2,
        Reason.SCALE_DOWN_SLACK,
    ),
    # N/(N-1) guard: 2 replicas at 0.5 -> 1 replica would run at 1.0 > 0.9: hold.
    Case(
        "n/(n-1) guard holds",
        Pool.PREFILL,
        2,
        2,
        sig(latency=0.5),
        SLACK_LONG,
        2,
        Reason.SURVIVORS_WOULD_OVERLOAD,
    ),
    # ... and 2 replicas at 0.45 -> 0.9 fits: go to 1.
    Case(
        "n/(n-1) guard allows",
        Pool.PREFILL,
        2,
        2,
        sig(latency=0.45),
        SLACK_LONG,
        1,
        Reason.SCALE_DOWN_SLACK,
    ),
    Case(
        "slack not yet sustained",
        Pool.PREFILL,
        4,
        4,
        sig(latency=0.3, warm=4),
        PoolMemory(last_scale_time=LONG_AGO, slack_since=NOW - 60),
        4,
        Reason.SLACK_NOT_SUSTAINED,
    ),
    Case(
        "down blocked by cooldown",
        Pool.PREFILL,
        4,
        4,
        sig(latency=0.3, warm=4),
        PoolMemory(last_scale_time=NOW - 60, slack_since=LONG_AGO),
        4,
        Reason.COOLDOWN,
    ),
    Case(
        "down never below min",
        Pool.DECODE,
        1,
        1,
        sig(latency=0.001, warm=1),
        SLACK_LONG,
        1,
        Reason.AT_MIN,
    ),
    Case(
        "down waits for pending",
        Pool.PREFILL,
        4,
        3,
        sig(latency=0.2, warm=3),
        SLACK_LONG,
        4,
        Reason.CAPACITY_PENDING,
    ),
    # Zero traffic: straight to min once sustained.
    Case("idle to min", Pool.DECODE, 5, 5, IDLE, SLACK_LONG, 1, Reason.SCALE_TO_MIN_IDLE),
    Case(
        "idle not yet sustained",
        Pool.DECODE,
        5,
        5,
        IDLE,
        PoolMemory(last_scale_time=LONG_AGO),
        5,
        Reason.SLACK_NOT_SUSTAINED,
    ),
    Case("idle at min", Pool.PREFILL, 1, 1, IDLE, PoolMemory(), 1, Reason.IDLE_AT_MIN),
    # Bounds changed under us: clamp at once, cooldown or not.
    Case(
        "clamp above max",
        Pool.PREFILL,
        9,
        9,
        sig(latency=5.0),
        PoolMemory(NOW - 1),
        6,
        Reason.CLAMPED_TO_BOUNDS,
    ),
    Case("clamp below min", Pool.DECODE, 0, 0, None, PoolMemory(), 1, Reason.CLAMPED_TO_BOUNDS),
    Case("no metrics holds", Pool.DECODE, 3, 3, None, PoolMemory(), 3, Reason.NO_METRICS),
    # A prefill pool at 0 (decode prefills locally) comes back when TTFT breaches.
    Case(
        "prefill from zero",
        Pool.PREFILL,
        0,
        0,
        sig(latency=1.5, warm=0),
        PoolMemory(),
        1,
        Reason.SCALE_UP_LATENCY,
        replace(PREFILL, min_replicas=0),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decision_table(case: Case) -> None:
    policy = case.policy or (PREFILL if case.pool is Pool.PREFILL else DECODE)
    decision = decide(
        case.pool, PoolState(case.current, case.ready), case.signals, case.memory, policy, NOW
    )
    assert (decision.desired, decision.reason) == (case.desired, case.reason)
    assert decision.current == case.current
    if decision.changed:
        assert decision.memory.last_scale_time == NOW
        assert decision.memory.slack_since is None


def test_slack_clock_starts_and_resets() -> None:
    fresh = decide(
        Pool.PREFILL, PoolState(4, 4), sig(latency=0.3, warm=4), PoolMemory(), PREFILL, NOW
    )
    assert fresh.reason is Reason.SLACK_NOT_SUSTAINED
    assert fresh.memory.slack_since == NOW
    busy = decide(
        Pool.PREFILL, PoolState(4, 4), sig(latency=1.0, warm=4), fresh.memory, PREFILL, NOW + 15
    )
    assert busy.reason is Reason.WITHIN_TOLERANCE
    assert busy.memory.slack_since is None


def test_no_flapping_under_steady_load() -> None:
    """A load that just needs 3 replicas settles at 3 and stays there."""
    demand = 2.7  # replica-equivalents of work
    memory, current, history = PoolMemory(), 1, []
    for step in range(60):
        now = NOW + 15 * step
        ratio = demand / current
        signals = sig(latency=ratio * PREFILL.latency_target, warm=current)
        d = decide(Pool.PREFILL, PoolState(current, current), signals, memory, PREFILL, now)
        memory, current = d.memory, d.desired
        history.append(current)
    assert history == [3] * 60  # one step up from 1, then never moves again


def test_load_ratio_picks_worst_signal() -> None:
    ratio, signal = load_ratio(Pool.DECODE, sig(latency=0.04, kv=0.88, running=10), DECODE)
    assert signal is Signal.KV_CACHE
    assert ratio == pytest.approx(1.1)


def test_status_record_carries_numbers() -> None:
    d = decide(
        Pool.PREFILL, PoolState(2, 2), sig(latency=2.5, waiting=3), PoolMemory(), PREFILL, NOW
    )
    record = d.to_status(PREFILL)
    assert record["from"] == 2 and record["to"] == 5
    assert record["reason"] == "ScaleUpLatency"
    assert record["signal"] == "latency"
    assert record["loadRatio"] == 2.5
    assert record["metrics"]["latencyP90Seconds"] == 2.5
    assert record["metrics"]["waiting"] == 3
    assert "prefill: 2 -> 5 (ScaleUpLatency)" in record["message"]
