"""fit_serving: the simulator, run in the serving calibration's own conditions, gives back the
calibration's measured medians."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.calibrate import ISL, OSL
from tandem.engine.sim.profile import Profile, ServingCost
from tandem.planner.sim_worker import POLL_SECONDS
from tandem.serving_fit import _lone, fit_serving

MEASURED = ServingCost(
    request_seconds=0.004, token_seconds=0.001, handoff_seconds=0.003, step_seconds=0.0005,
    row_seconds=0.0008, router_request_cpu=0.001, router_token_cpu=0.0004,
    worker_request_cpu=0.002, decode_request_cpu=0.0025, client_token_cpu=0.0002,
    request_spread=(0.0045, 0.005, 0.0055),
)  # fmt: skip


def _targets(p: Profile) -> tuple[float, float, float]:
    """The calibration's medians, as serving_cost's figures give them back."""
    s, step = p.serving, p.step
    pull = p.transfer.seconds("tcp", -(-ISL // p.engine.block_size) * p.engine.block_bytes)
    return (
        step.step_seconds([(1, ISL + OSL // 2)]) + s.step_seconds,
        step.step_seconds([(ISL, 0)]) + s.step_seconds + s.request_seconds + s.token_seconds,
        pull + POLL_SECONDS / 2 + step.step_seconds([(1, ISL)]) + s.step_seconds
        + s.handoff_seconds,
    )  # fmt: skip


def _simulated(p: Profile, cores: int) -> tuple[float, float, float]:
    itl, ttft = _lone(p, cores, "tcp", 0, ISL, OSL)
    return itl, ttft, _lone(p, cores, "tcp", 1, ISL, 2)[0]


def test_the_fitted_profile_reproduces_the_calibration_on_its_cores() -> None:
    raw = synthetic_profile(serving=MEASURED)
    # As measured, the simulator counts the CPU inside the figures a second time: a lone
    # request's ITL, first token and hand-off gap all come out above the calibration's.
    want = _targets(raw)
    before = _simulated(raw, 2)
    assert all(b > w * 1.05 for b, w in zip(before, want, strict=True))
    fitted = fit_serving(raw, 2, "tcp", ISL, OSL)
    assert _simulated(fitted, 2) == pytest.approx(want, rel=0.005)
    s = fitted.serving
    assert s.step_seconds < MEASURED.step_seconds
    assert s.request_seconds < MEASURED.request_seconds
    assert s.handoff_seconds < MEASURED.handoff_seconds
    # The spread moves with the median it is drawn around; the CPU figures are measurements.
    shift = s.request_seconds - MEASURED.request_seconds
    assert s.request_spread == pytest.approx([x + shift for x in MEASURED.request_spread])
    assert (s.row_seconds, s.worker_request_cpu) == (0.0008, 0.002)


def test_a_profile_the_simulator_already_reproduces_is_left_alone() -> None:
    # No CPU to count twice: the simulator's lone request is the calibration's.
    consistent = replace(
        MEASURED,
        row_seconds=0.0,
        router_request_cpu=0.0,
        router_token_cpu=0.0,
        worker_request_cpu=0.0,
        decode_request_cpu=0.0,
        client_token_cpu=0.0,
    )
    raw = synthetic_profile(serving=consistent)
    assert _simulated(raw, 2) == pytest.approx(_targets(raw))
    fitted = fit_serving(raw, 2, "tcp", ISL, OSL).serving
    assert (fitted.step_seconds, fitted.request_seconds, fitted.handoff_seconds) == pytest.approx(
        (consistent.step_seconds, consistent.request_seconds, consistent.handoff_seconds), abs=1e-6
    )
