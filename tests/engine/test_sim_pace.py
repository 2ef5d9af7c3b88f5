"""engine/sim/pace.py: a profile moved to the machine's pace, and the pace from a probe."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.engine.sim.pace import at_pace, pace_factor, probe_labels
from tandem.engine.sim.profile import ServingCost, StepPoint
from tests.sim_profiles import synthetic_profile


def _point(label: str, seconds: float) -> StepPoint:
    return StepPoint(label=label, rows=((1, 32, 1),), execute_seconds=seconds,
                     host_seconds=0.0, samples=(seconds,))  # fmt: skip


LABELS = [
    "prefill q=16 ctx=0", "prefill q=128 ctx=0", "prefill q=64 ctx=64", "prefill q=256 ctx=0",
    "decode batch=1 ctx=224", "decode batch=1 ctx=32", "decode batch=8 ctx=32",
    "decode batch=16 ctx=32", "decode batch=4 ctx=32", "mixed batch=4 ctx=32 q=64",
]  # fmt: skip


def test_at_pace_scales_every_duration_and_keeps_ratios_and_points() -> None:
    serving = ServingCost(0.002, 0.001, 0.003, 0.0004, 0.00002, router_request_cpu=0.005,
                          client_token_cpu=0.0001, request_spread=(0.9, 1.0, 1.5),
                          pace_spread=(0.8, 1.2), pace_seconds=0.5)  # fmt: skip
    base = replace(synthetic_profile(execute=(0.002, 1e-5, 1e-4, 0, 1e-8, 2e-8, 3e-9),
                                     host=(1e-4, 0, 0, 0, 0, 0, 0), serving=serving),
                   step_points=(_point("decode batch=1 ctx=32", 0.001),))  # fmt: skip
    slow = at_pace(base, 1.5)
    rows = [(64, 0), (1, 100), (1, 300)]
    assert slow.step.step_seconds(rows) == pytest.approx(1.5 * base.step.step_seconds(rows))
    assert slow.transfer.seconds("tcp", 1 << 20) == pytest.approx(
        1.5 * base.transfer.seconds("tcp", 1 << 20)
    )
    assert slow.serving.request_seconds == pytest.approx(0.003)
    assert slow.serving.router_request_cpu == pytest.approx(0.0075)
    assert slow.serving.client_token_cpu == pytest.approx(0.00015)
    assert slow.serving.pace_seconds == pytest.approx(0.75)
    # Spreads are ratios to a median: a slower machine does not change them.
    assert slow.serving.request_spread == (0.9, 1.0, 1.5)
    assert slow.serving.pace_spread == (0.8, 1.2)
    assert slow.step_points == base.step_points  # the raw points stay as measured
    assert at_pace(base, 1.0) == base


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_at_pace_refuses_a_factor_that_is_not_a_pace(factor: float) -> None:
    with pytest.raises(ValueError, match="pace factor must be finite and > 0"):
        at_pace(synthetic_profile(), factor)


def test_probe_labels_pick_light_decodes_and_the_shortest_plain_prompt() -> None:
    profile = replace(synthetic_profile(),
                      step_points=tuple(_point(label, 0.001) for label in LABELS))  # fmt: skip
    assert probe_labels(profile) == [
        "decode batch=1 ctx=32", "decode batch=8 ctx=32", "prefill q=128 ctx=0",
    ]  # fmt: skip
    only_one = replace(profile, step_points=(_point("decode batch=1 ctx=64", 0.001),))
    assert probe_labels(only_one) == ["decode batch=1 ctx=64"]
    assert probe_labels(synthetic_profile()) == []


def test_pace_factor_is_the_geometric_mean_of_now_over_then() -> None:
    profile = replace(synthetic_profile(), step_points=(
        _point("decode batch=1 ctx=32", 0.001), _point("prefill q=128 ctx=0", 0.004),
    ))  # fmt: skip
    got = pace_factor(profile, {"decode batch=1 ctx=32": 0.002, "prefill q=128 ctx=0": 0.002})
    assert got == pytest.approx(1.0)  # 2x and 0.5x
    assert pace_factor(profile, {"decode batch=1 ctx=32": 0.0013}) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="no step point 'decode batch=2 ctx=32'"):
        pace_factor(profile, {"decode batch=2 ctx=32": 0.001})
    with pytest.raises(ValueError, match="at least one probed point"):
        pace_factor(profile, {})
    with pytest.raises(ValueError, match="times must be > 0"):
        pace_factor(profile, {"decode batch=1 ctx=32": 0.0})
