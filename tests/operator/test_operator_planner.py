"""The operator's planner: the pure rules (answer parsing, rate buckets, corrections, the
floor's decision table) and the real `tandem plan` subprocess behind PlannerClient."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from sim_profiles import synthetic_profile

from tandem.child_command import tandem_argv
from tandem.operator.autoscaler import (
    Decision,
    Pool,
    PoolMemory,
    PoolPolicy,
    PoolSignals,
    Reason,
)
from tandem.operator.children import Replicas
from tandem.operator.planner_client import PlannerClient, interval_floors, query_for
from tandem.operator.planning import (
    PlanAnswer,
    PlanError,
    apply_floor,
    floor_note,
    parse_plan,
    rate_bucket,
    update_correction,
)
from tandem.operator.spec import parse_spec
from tandem.planner.cli import build_parser, workload_from
from tandem.planner.search import SLO, Planner
from tandem.planner.simulator import Deployment

NOW = 50_000.0
POLICY = PoolPolicy(1, 6, 0.05, 0.8, 32.0, 0.1, 30.0, 120.0)
MEMORY = PoolMemory(last_scale_time=NOW - 1000, slack_since=NOW - 500)


def decision(current: int, desired: int, reason: Reason) -> Decision:
    return Decision(Pool.DECODE, current, desired, reason, 0.5, None, None, MEMORY)


def answer_json(**over: object) -> str:
    body = {"feasible": True, "prefill": 2, "decode": 5,
            "predicted": {"ttft_p90": 0.4, "itl_p90": 0.03, "e2e_p90": 3.0}}  # fmt: skip
    body.update(over)
    return json.dumps(body)


def test_parse_plan_reads_counts_and_predictions() -> None:
    assert parse_plan(answer_json()) == PlanAnswer(2, 5, True, 0.4, 0.03)
    closest = parse_plan(answer_json(feasible=False, predicted={"ttft_p90": None}))
    assert (closest.feasible, closest.ttft_p90, closest.itl_p90) == (False, None, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "must be an object"),
        (answer_json(decode=0), "decode must be an integer in"),
        (answer_json(prefill=-1), "prefill must be an integer in"),
        (answer_json(prefill=True), "prefill must be an integer"),
        (answer_json(feasible="yes"), "feasible must be a boolean"),
        (answer_json(predicted={"ttft_p90": -1}), "predicted.ttft_p90"),
        (answer_json(predicted={"itl_p90": "fast"}), "predicted.itl_p90"),
    ],
)
def test_a_malformed_answer_is_an_error_never_a_floor(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_plan(text)


@pytest.mark.parametrize(
    ("rate", "bucket"),
    [(4.21, 4.3), (4.3, 4.3), (0.0123, 0.013), (118, 120), (1, 1.0), (9.91, 10), (25.0, 25.0)],
)
def test_rates_round_up_to_two_significant_digits(rate: float, bucket: float) -> None:
    assert rate_bucket(rate) == pytest.approx(bucket)


def test_rate_bucket_refuses_no_traffic() -> None:
    with pytest.raises(ValueError, match="> 0"):
        rate_bucket(0.0)


@pytest.mark.parametrize(
    ("previous", "measured", "predicted", "expected"),
    [
        (1.0, 0.3, 0.2, 1.25),  # 1.5x slower than predicted: halfway there
        (1.0, 0.1, 0.2, 0.75),
        (1.0, 10.0, 0.1, 2.5),  # ratio bounded to 4 before blending
        (3.5, 10.0, 0.1, 3.75),
        (1.0, 0.001, 1.0, 0.75),  # bounded to 0.5
        (1.2, None, 0.2, 1.2),  # nothing measured: unchanged
        (1.2, 0.2, None, 1.2),
        (1.2, 0.2, 0.0, 1.2),
    ],
)
def test_correction_is_a_bounded_moving_average(
    previous: float, measured: float | None, predicted: float | None, expected: float
) -> None:
    assert update_correction(previous, measured, predicted) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("current", "reactive", "reason", "floor", "desired", "final_reason", "moved"),
    [
        (2, 2, Reason.WITHIN_TOLERANCE, 4, 4, Reason.PLANNER_FLOOR, True),  # plan raises
        (2, 3, Reason.SCALE_UP_LATENCY, 4, 4, Reason.PLANNER_FLOOR, True),
        (2, 5, Reason.SCALE_UP_LATENCY, 4, 5, Reason.SCALE_UP_LATENCY, True),  # reactive wins
        (4, 2, Reason.SCALE_DOWN_SLACK, 3, 3, Reason.PLANNER_FLOOR, True),  # down to the floor
        (3, 2, Reason.SCALE_DOWN_SLACK, 3, 3, Reason.PLANNER_FLOOR, False),  # floor holds
        (2, 2, Reason.COOLDOWN, 9, 6, Reason.PLANNER_FLOOR, True),  # floor within max 6
        (2, 2, Reason.AT_MIN, 0, 2, Reason.AT_MIN, False),  # floor below min: no effect
    ],
)
def test_floor_decision_table(
    current: int, reactive: int, reason: Reason, floor: int, desired: int,
    final_reason: Reason, moved: bool,
) -> None:  # fmt: skip
    d = decision(current, reactive, reason)
    out = apply_floor(d, floor, POLICY, NOW, "plan note")
    assert (out.desired, out.reason) == (desired, final_reason)
    assert out.note == "plan note" and out.message(POLICY).endswith("; plan note")
    if final_reason is Reason.PLANNER_FLOOR and out.desired != current:
        assert out.memory == PoolMemory(last_scale_time=NOW, slack_since=None)
    elif final_reason is Reason.PLANNER_FLOOR:
        assert out.memory == MEMORY
    assert out.changed == moved
    assert out.to_status(POLICY)["reason"] == final_reason.camel


def test_floor_note_names_the_plan() -> None:
    plan = PlanAnswer(2, 5, True, 0.4, 0.03)
    assert floor_note("decode", 5, 4.3, 1.25, plan) == (
        "plan for 4.3 req/s (x1.25 correction) is 2P5D; decode floor 5"
    )
    colocated = replace(plan, prefill=0, decode=3, feasible=False)
    assert "is 3 colocated, infeasible: closest miss" in floor_note("decode", 3, 1, 1, colocated)


SPEC = parse_spec(
    {
        "router": {"policy": "round-robin", "localPrefillThreshold": 0},
        "kvTransfer": {"transport": "tcp"},
        "autoscaling": {
            "enabled": True, "planner": True, "ttftSeconds": 1.0, "itlSeconds": 0.15,
            "prefill": {"maxReplicas": 5}, "decode": {"maxReplicas": 3},
        },
        "workload": {"inputTokens": 400, "outputTokens": 11, "requestsPerSecond": 5},
    }
)  # fmt: skip
# The TTFT-bound case of tests/planner/test_plan_search.py, ten times slower: 0.5 s prompts.
PROFILE = synthetic_profile(execute=(0.1, 1e-3, 0, 0, 0, 0, 0), transfer=(0.0, 0.0),
                            max_num_batched_tokens=512, max_model_len=1024)  # fmt: skip


def profile_text() -> str:
    return json.dumps(PROFILE.to_dict())


def in_process_plan(rate: float) -> tuple[int, int]:
    """What `tandem plan` answers for the operator's query, planned in this process."""
    args = build_parser().parse_args(query_for(SPEC, rate).argv("unused")[1:])
    base = Deployment(local_prefill_threshold=0, kv_transport="tcp", policy="round-robin")
    slo = SLO(args.ttft_p90, args.itl_p90, args.slo_view)
    assert (args.slo_view, args.min_prefill) == ("router", 1)
    planner = Planner(PROFILE, workload_from(args), slo, base, max_workers=8, min_prefill=1)
    best = planner.plan().best
    assert best is not None
    return best.deployment.prefill, best.deployment.decode


def test_the_query_carries_the_spec_into_tandem_plan() -> None:
    q = query_for(SPEC, 49.2)
    argv = q.argv("/p.json")
    assert argv[:3] == ["plan", "--profile", "/p.json"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--rate"] == "50.0" and flags["--isl"] == "400" and flags["--osl"] == "11"
    assert flags["--max-workers"] == "8" and flags["--kv-transport"] == "tcp"
    assert flags["--policy"] == "round-robin" and flags["--ttft-p90"] == "1.0"
    assert argv[-1] == "--json"


def signals(rate: float, ttft: float | None, itl: float | None) -> dict[Pool, PoolSignals]:
    return {
        Pool.PREFILL: PoolSignals(ttft, 0, 1, None, rate, 100.0, 3),
        Pool.DECODE: PoolSignals(itl, 0, 4, 0.2, rate, 100.0, 1),
    }


def test_interval_floors_run_the_real_planner_and_learn_only_on_plan(tmp_path: Path) -> None:
    planner = PlannerClient(tandem_argv(), timeout_seconds=120)

    async def run() -> None:
        text = profile_text()
        # Running 1P1D, not the plan: measured latency teaches nothing.
        planned = in_process_plan(5.0)
        out = await interval_floors(planner, text, SPEC, signals(4.96, 9.0, 0.2),
                                    Replicas(1, 1), {})  # fmt: skip
        assert (out.floors[Pool.PREFILL], out.floors[Pool.DECODE]) == planned
        assert planned[0] >= 3  # 2.5 s of prefill per second of traffic
        assert out.corrections == {Pool.PREFILL: 1.0, Pool.DECODE: 1.0}
        assert out.status["observedRate"] == 4.96 and out.rates[Pool.PREFILL] == 5.0
        assert planner.runs == 1
        # Running the plan with TTFT twice the prediction: correction 1.5, so prefill is
        # planned for 7.5 req/s; decode, measured as predicted, keeps the 5 req/s plan.
        predicted = out.status["plan"]["predictedTtftP90Seconds"]
        status = {"autoscaling": {"planner": out.status}}
        running = Replicas(*planned)
        again = await interval_floors(planner, text, SPEC, signals(5, 2 * predicted, None),
                                      running, status)  # fmt: skip
        assert again.corrections[Pool.PREFILL] == pytest.approx(1.5)
        assert again.rates == {Pool.PREFILL: 7.5, Pool.DECODE: 5.0}
        assert again.floors[Pool.PREFILL] == in_process_plan(7.5)[0] > planned[0]
        assert planner.runs == 2  # the 5 req/s plan came from the cache
        idle = await interval_floors(planner, text, SPEC, signals(0, None, None),
                                     Replicas(3, 1), status)  # fmt: skip
        assert idle.floors == {} and idle.status["message"] == "no traffic observed: no floor"

    try:
        asyncio.run(run())
    finally:
        planner.close()


def test_a_failing_planner_is_an_error_and_is_not_rerun_at_once(tmp_path: Path) -> None:
    planner = PlannerClient(tandem_argv(), retry_seconds=3600)

    async def run() -> None:
        for _ in range(2):
            with pytest.raises(PlanError, match=r"tandem plan failed \(2\)"):
                await planner.plan('{"format": "nope"}', query_for(SPEC, 5))
        assert planner.runs == 1

    try:
        asyncio.run(run())
    finally:
        planner.close()
