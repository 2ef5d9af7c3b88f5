"""plan_noise: a validation run's residuals, biases and the odds a predictor passes."""

import math
import statistics

import pytest
from plan_noise import (
    ClassNoise,
    case_residuals,
    class_noise,
    observed,
    pass_chance,
    run_odds,
)
from plan_report import Row


def _row(workload: str, ttft: list[float], p_ttft: list[float], itl: list[float],
         p_itl: list[float]) -> Row:  # fmt: skip
    return Row(
        model="demo", workload=workload, load="light", rate=5.0, deployment="colocated",
        requests=20, measured_ttft_p90=statistics.median(ttft),
        predicted_ttft_p90=statistics.median(p_ttft), measured_itl_p90=statistics.median(itl),
        predicted_itl_p90=statistics.median(p_itl), failed=0, ttft_rounds=tuple(ttft),
        itl_rounds=tuple(itl), predicted_ttft_rounds=tuple(p_ttft),
        predicted_itl_rounds=tuple(p_itl),
    )  # fmt: skip


def _class(residuals: list[tuple[float, float, float, float]], workloads: int = 1) -> ClassNoise:
    bias = {f"w{i}": (0.0, 0.0) for i in range(workloads)}
    return ClassNoise("demo", "light", "colocated", tuple(residuals), bias)


def test_residuals_are_log_deviations_from_the_case_mean_scaled_for_its_rounds() -> None:
    e = math.e
    got = case_residuals([1.0, e, e * e], [2.0, 2.0, 2.0])
    scale = math.sqrt(3 / 2)
    assert [g[0] for g in got] == pytest.approx([-scale, 0.0, scale])
    assert [g[1] for g in got] == pytest.approx([0.0, 0.0, 0.0])


def test_class_noise_keeps_a_rounds_four_residuals_together_and_each_workloads_bias() -> None:
    rows = [
        # TTFT predicted 10 % over in every round, ITL exact.
        _row("chat", [0.010, 0.020, 0.040], [0.011, 0.022, 0.044], [1e-3] * 3, [1e-3] * 3),
        _row("chat", [0.010] * 3, [0.012] * 3, [1e-3] * 3, [1e-3] * 3),  # 20 % over
    ]
    (c,) = class_noise(rows)
    assert len(c.residuals) == 6
    # The first case's TTFT rounds double: deviations of -ln 2, 0, +ln 2 (scaled), measured and
    # predicted alike.
    scale = math.sqrt(3 / 2)
    assert [r[0] for r in c.residuals[:3]] == pytest.approx([-scale * math.log(2), 0.0,
                                                             scale * math.log(2)])  # fmt: skip
    assert [r[1] for r in c.residuals[:3]] == pytest.approx([r[0] for r in c.residuals[:3]])
    assert c.correlation(0, 1) == pytest.approx(1.0)
    assert c.bias["chat"][0] == pytest.approx((math.log(1.1) + math.log(1.2)) / 2)
    assert c.bias["chat"][1] == pytest.approx(0.0)


def test_a_quiet_case_passes_within_the_tolerance_and_fails_past_it() -> None:
    quiet = _class([(0.0, 0.0, 0.0, 0.0)] * 4)
    assert pass_chance(quiet, 3, True, (0.0, 0.0)) == 1.0
    assert pass_chance(quiet, 3, True, (math.log(1.2), 0.0)) == 1.0
    assert pass_chance(quiet, 3, True, (0.0, math.log(1.3))) == 0.0
    assert pass_chance(quiet, 3, True, (math.log(0.7), 0.0)) == 0.0


def test_measured_rounds_too_far_apart_fail_even_a_perfect_predictor() -> None:
    # Every measured TTFT round 0.5 (log) off its centre: the median is too, whatever the rounds.
    loud = _class([(0.5, 0.0, 0.0, 0.0), (-0.5, 0.0, 0.0, 0.0)])
    assert pass_chance(loud, 1, False, (0.0, 0.0)) == 0.0
    assert pass_chance(loud, 3, False, (0.0, 0.0)) == 0.0
    # +-0.1: within 25 % either way.
    mild = _class([(0.1, 0.0, 0.0, 0.0), (-0.1, 0.0, 0.0, 0.0)])
    assert pass_chance(mild, 3, False, (0.0, 0.0)) == 1.0


def test_more_rounds_raise_the_chance_when_a_round_is_sometimes_far_off() -> None:
    # One round in four is 0.5 off: one round fails a quarter of the time; a median of five
    # needs three such rounds.
    sometimes = _class([(0.5, 0.0, 0.0, 0.0)] + [(0.0, 0.0, 0.0, 0.0)] * 3)
    one = pass_chance(sometimes, 1, False, (0.0, 0.0))
    five = pass_chance(sometimes, 5, False, (0.0, 0.0))
    assert one == pytest.approx(0.75, abs=0.01)
    # P(at most 2 of 5 far rounds) = 1 - P(3, 4 or 5 of 5) at 1/4 each: 0.896.
    assert five == pytest.approx(0.896, abs=0.01)


def test_a_predictor_that_moves_with_the_measurement_passes_where_a_fixed_one_fails() -> None:
    together = _class([(0.5, 0.5, 0.0, 0.0), (-0.5, -0.5, 0.0, 0.0)])
    assert pass_chance(together, 1, True, (0.0, 0.0)) == 1.0
    assert pass_chance(together, 1, False, (0.0, 0.0)) == 0.0


def test_run_odds_multiply_over_cases_and_add_up_the_mean() -> None:
    quiet = _class([(0.0, 0.0, 0.0, 0.0)], workloads=3)
    sometimes = _class([(0.5, 0.0, 0.0, 0.0)] + [(0.0, 0.0, 0.0, 0.0)] * 3, workloads=2)
    odds = run_odds([quiet, sometimes], 1, spread=False)
    assert odds.all_pass == pytest.approx(0.75**2, abs=0.02)
    assert odds.mean_cases == pytest.approx(3 + 2 * 0.75, abs=0.02)


def test_observed_counts_cases_and_single_rounds_per_run() -> None:
    rows = [
        # Within on the medians; one round of three off (0.030 against 0.020).
        _row("chat", [0.020, 0.021, 0.030], [0.020] * 3, [1e-3] * 3, [1e-3] * 3),
        # ITL 33 % under in every round.
        _row("decode-heavy", [0.02] * 3, [0.02] * 3, [3e-3] * 3, [2e-3] * 3),
        _row("chat", [0.02] * 3, [0.02] * 3, [1e-3] * 3, [1e-3] * 3),
    ]
    got = observed(rows, 2)
    assert got.cases == 1.0  # (1 + 0 + 1) over two runs
    assert got.singles == pytest.approx((2 / 3 + 0 + 1) / 2)
    assert got.paired == 1.0  # the first case's round errors 0, -5 %, -33 %: median -5 %


def test_paired_judges_the_median_of_each_rounds_own_error() -> None:
    # Medians 0.011 predicted against 0.03 measured: -63 %, a miss. Round by round: +10 %,
    # -63 %, 0 %: the median error is 0 %.
    rows = [_row("chat", [0.01, 0.03, 0.03], [0.011, 0.011, 0.03], [1e-3] * 3, [1e-3] * 3)]
    got = observed(rows, 1)
    assert got.cases == 0.0
    assert got.paired == 1.0
