"""``planner/consistency.py``: a profile simulated on shared cores gives back the lone latencies
it was calibrated from, and nothing changes where nothing was counted twice."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.engine.sim.profile import CALIBRATION_ISL, CALIBRATION_OSL, ServingCost
from tandem.planner.consistency import consistent, lone_latencies, lone_targets

# A demo-like host: 0.4 ms decode steps with 0.3 ms of overhead, and a router, a streaming
# thread and a client each spending about as much again per token on the same two cores.
SERVING = ServingCost(
    request_seconds=0.005, token_seconds=0.001, step_seconds=0.0003, row_seconds=0.00025,
    router_request_cpu=0.002, router_token_cpu=0.0003, worker_request_cpu=0.0015,
    client_request_cpu=0.003, client_token_cpu=0.0002, router_wake_share=0.6,
    client_wake_share=0.5, row_wake_share=0.7, run_queue_wait=0.0015,
    request_spread=(0.0045, 0.005, 0.0054, 0.0057, 0.006, 0.0062, 0.0065, 0.007, 0.0078, 0.0095),
)  # fmt: skip
PROFILE = synthetic_profile(execute=(0.0004, 1e-5, 0, 0, 0, 0, 0), serving=SERVING)


def test_the_targets_are_the_calibrations_lone_medians_put_back_together() -> None:
    ttft, itl = lone_targets(PROFILE)
    decode = PROFILE.step.step_seconds([(1, CALIBRATION_ISL + CALIBRATION_OSL // 2)])
    prefill = PROFILE.step.step_seconds([(CALIBRATION_ISL, 0)])
    assert itl == pytest.approx(decode + 0.0003)
    assert ttft == pytest.approx(prefill + 0.0003 + 0.00025 + 0.005 + 0.001)


def test_on_shared_cores_the_simulator_counts_the_sharing_twice_and_the_fit_removes_it() -> None:
    ttft, itl = lone_targets(PROFILE)
    before = lone_latencies(PROFILE, 2)
    assert before[0] > 1.1 * ttft and before[1] > 1.1 * itl  # the double count
    fitted = consistent(PROFILE, 2)
    after = lone_latencies(fitted, 2)
    # The first token falls smoothly with the shift; the ITL jumps where a thread's wake-up
    # starts or stops finding the cores full, and the fit stops at the jump below its target.
    assert after[0] == pytest.approx(ttft, rel=0.01)
    assert 0.85 * itl <= after[1] <= itl
    sv, fs = PROFILE.serving, fitted.serving
    assert 0.0 <= fs.step_seconds < sv.step_seconds
    # The first token's serving latency moves by one amount, every quantile alike.
    shift = sv.request_seconds - fs.request_seconds
    assert shift > 0.0
    assert fs.request_spread == pytest.approx([q - shift for q in sv.request_spread])
    # Everything else is the profile's.
    assert replace(fs, step_seconds=sv.step_seconds, request_seconds=sv.request_seconds,
                   request_spread=sv.request_spread) == sv  # fmt: skip
    assert fitted.step == PROFILE.step


def test_a_profile_the_simulator_already_gives_back_is_unchanged() -> None:
    # Nothing beside the steps (no serving CPU): the sharing adds nothing to count twice.
    bare = replace(PROFILE, serving=ServingCost(request_seconds=0.004, token_seconds=0.001,
                                                step_seconds=0.0003))  # fmt: skip
    assert consistent(bare, 2) == bare


def test_a_double_count_larger_than_the_figure_stops_at_zero() -> None:
    # A tiny overhead beside heavy serving CPU: even none leaves the lone ITL over its target.
    heavy = replace(PROFILE, serving=replace(SERVING, step_seconds=1e-6, row_seconds=0.002))
    assert consistent(heavy, 2).serving.step_seconds == 0.0
