"""plan_contention: where each process is pinned, and the table of the phases."""

import pytest
from plan_contention import Phase, p90, pin_plan, render


def test_the_prefill_worker_gets_the_first_cpu_and_every_other_process_the_rest() -> None:
    children = [("router", 10), ("prefill", 11), ("decode", 12)]
    assert pin_plan(children, [0, 1]) == {10: "1", 11: "0", 12: "1"}
    assert pin_plan(children, [2, 3, 5]) == {10: "3,5", 11: "2", 12: "3,5"}
    # The workers apart, the router free on every CPU.
    assert pin_plan(children, [0, 1], workers_only=True) == {10: "0,1", 11: "0", 12: "1"}


def test_pinning_apart_needs_two_cpus_and_one_prefill_worker() -> None:
    with pytest.raises(ValueError, match="two CPUs"):
        pin_plan([("prefill", 11)], [0])
    with pytest.raises(ValueError, match="one prefill"):
        pin_plan([("router", 10), ("decode", 12)], [0, 1])
    with pytest.raises(ValueError, match="one prefill"):
        pin_plan([("prefill", 11), ("prefill", 13)], [0, 1])


def test_p90_is_the_nearest_rank() -> None:
    assert p90([float(v) for v in range(1, 11)]) == 9.0
    assert p90([float(v) for v in range(1, 21)]) == 18.0
    assert p90([3.0, 1.0, 2.0]) == 3.0
    assert p90([5.0]) == 5.0


def test_render_gives_each_phase_its_medians_p90s_and_gap_in_ms() -> None:
    phases = [
        Phase("unpinned", (0.050, 0.055, 0.060), (0.070, 0.080, 0.090)),
        Phase("prefill pinned apart", (0.052, 0.054, 0.056), (0.050, 0.053, 0.058)),
    ]
    lines = render(phases).splitlines()
    assert lines[2] == "| unpinned | 55.0 / 60.0 ms | 80.0 / 90.0 ms | +25.0 ms |"
    assert lines[3] == "| prefill pinned apart | 54.0 / 56.0 ms | 53.0 / 58.0 ms | -1.0 ms |"
