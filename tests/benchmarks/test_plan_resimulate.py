"""plan_resimulate: a saved validation run's predictions made again from its own profiles."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from plan_resimulate import resimulate, stretch_paces, stretched_p90s
from plan_validation import _simulate, case_dir, engine_seconds
from sim_profiles import synthetic_profile, write_profile

from tandem.engine.sim.profile import StepPoint
from tandem.planner.workload import Arrival, Lengths, Workload

# workloads(256)["chat"]: 64 prompt tokens, 32 out.
CHAT = Workload(rate=5.0, isl=Lengths(64), osl=Lengths(32), num_requests=20,
                arrival=Arrival.POISSON)  # fmt: skip


def _run(tmp_path: Path, rounds: int, later_profiles: bool) -> Path:
    write_profile(tmp_path / "profile-demo.json", execute=(0.002, 1e-5, 0, 0, 0, 0, 0))
    if later_profiles:
        for r in range(2, rounds + 1):
            write_profile(tmp_path / f"profile-demo-round{r}.json",
                          execute=(0.002 * r, 1e-5, 0, 0, 0, 0, 0))  # fmt: skip
    row = {"model": "demo", "workload": "chat", "load": "light", "rate": 5.0,
           "deployment": "1P1D", "requests": 20, "measured_ttft_p90": 0.02,
           "predicted_ttft_p90": 0.0, "measured_itl_p90": 0.003, "predicted_itl_p90": 0.0,
           "failed": 0, "ttft_rounds": [0.02] * rounds, "itl_rounds": [0.003] * rounds,
           "predicted_ttft_rounds": [0.0] * rounds,
           "predicted_itl_rounds": [0.0] * rounds}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps([row]))
    return tmp_path


def test_each_round_is_predicted_again_from_its_own_profile(tmp_path: Path) -> None:
    run = _run(tmp_path, 2, later_profiles=True)
    (row,) = resimulate(run, cores=2)
    want = [_simulate(run / name, CHAT, 1, 1, 2, simulated=False)
            for name in ("profile-demo.json", "profile-demo-round2.json")]  # fmt: skip
    assert row.predicted_ttft_rounds == tuple(w.ttft.p90 for w in want)
    assert row.predicted_itl_rounds == tuple(w.itl.p90 for w in want)
    assert row.predicted_worker_ttft_rounds == ()  # the run measured no worker histogram
    # The slower second profile predicts a slower round; the measurements are the run's.
    assert row.predicted_itl_rounds[1] > row.predicted_itl_rounds[0]
    assert row.predicted_itl_p90 == pytest.approx(sum(row.predicted_itl_rounds) / 2)
    assert (row.measured_ttft_p90, row.itl_rounds) == (0.02, (0.003, 0.003))


def test_a_run_with_one_profile_predicts_every_round_from_it(tmp_path: Path) -> None:
    (row,) = resimulate(_run(tmp_path, 3, later_profiles=False), cores=2)
    assert len(set(row.predicted_itl_rounds)) == 1 and len(row.predicted_itl_rounds) == 3


def test_a_run_that_measured_the_front_worker_gets_its_prediction_again(tmp_path: Path) -> None:
    run = _run(tmp_path, 2, later_profiles=True)
    (saved,) = json.loads((run / "results.json").read_text())
    saved["worker_ttft_rounds"] = [0.008, 0.009]
    saved["predicted_worker_ttft_rounds"] = [0.0, 0.0]
    (run / "results.json").write_text(json.dumps([saved]))
    (row,) = resimulate(run, cores=2)
    want = [_simulate(run / name, CHAT, 1, 1, 2, simulated=False).pools["prefill"].first_token.p90
            for name in ("profile-demo.json", "profile-demo-round2.json")]  # fmt: skip
    assert row.predicted_worker_ttft_rounds == tuple(want) and all(w > 0 for w in want)
    assert row.worker_ttft_rounds == (0.008, 0.009)


def test_a_case_that_saved_its_own_profile_is_predicted_from_it(tmp_path: Path) -> None:
    run = _run(tmp_path, 2, later_profiles=True)
    own = case_dir(run, "demo", "chat", "light", "1P1D", 1) / "profile.json"
    own.parent.mkdir(parents=True)
    write_profile(own, execute=(0.006, 1e-5, 0, 0, 0, 0, 0))
    (row,) = resimulate(run, cores=2)
    want = [_simulate(path, CHAT, 1, 1, 2, simulated=False).itl.p90
            for path in (run / "profile-demo.json", own)]  # fmt: skip
    assert row.predicted_itl_rounds == tuple(want)
    # --run-profiles: what the run's own profiles predict, the case's ignored.
    (plain,) = resimulate(run, cores=2, per_case=False)
    round2 = _simulate(run / "profile-demo-round2.json", CHAT, 1, 1, 2, simulated=False)
    assert plain.predicted_itl_rounds == (want[0], round2.itl.p90) != row.predicted_itl_rounds


def test_a_column_another_version_saved_is_ignored(tmp_path: Path) -> None:
    run = _run(tmp_path, 1, later_profiles=False)
    (saved,) = json.loads((run / "results.json").read_text())
    saved["pace_rounds"] = [1.2]
    (run / "results.json").write_text(json.dumps([saved]))
    (row,) = resimulate(run, cores=2)
    assert row.measured_itl_p90 == 0.003 and row.predicted_itl_p90 > 0


def test_a_run_that_measured_its_steps_is_predicted_again_at_their_pace(tmp_path: Path) -> None:
    run = _run(tmp_path, 2, later_profiles=True)
    plain = [_simulate(run / name, CHAT, 1, 1, 2, simulated=False)
             for name in ("profile-demo.json", "profile-demo-round2.json")]  # fmt: skip
    steps = [engine_seconds(s) for s in plain]
    (saved,) = json.loads((run / "results.json").read_text())
    # The first round's steps ran at the simulated pace, the second's 1.5x slower.
    saved["busy_rounds"] = [steps[0], 1.5 * steps[1]]
    (run / "results.json").write_text(json.dumps([saved]))
    (row,) = resimulate(run, cores=2)
    assert row.predicted_busy_rounds == tuple(steps) and all(s > 0 for s in steps)
    assert row.pace_rounds == pytest.approx((1.0, 1.5))
    assert row.paced_itl_rounds[0] == plain[0].itl.p90  # at the profile's own pace: the same
    slow = _simulate(run / "profile-demo-round2.json", CHAT, 1, 1, 2, simulated=False, pace=1.5)
    assert row.paced_itl_rounds[1] == slow.itl.p90 > plain[1].itl.p90
    # A run saved before the steps were measured: no pace.
    (tmp_path / "older").mkdir()
    (older,) = resimulate(_run(tmp_path / "older", 2, later_profiles=True), cores=2)
    assert older.pace_rounds == () and older.paced_itl_rounds == ()


def _point(execute: float, samples: list[float]) -> StepPoint:
    return StepPoint("p", ((1, 0, 1),), execute, 0.0, tuple(samples))


def test_the_stretch_paces_are_the_deciles_of_each_pass_median_over_their_median() -> None:
    # Two points, three passes of two samples each: pass medians 1.5, 1, 2 ms over 1 ms and
    # 4, 4, 6 ms over 2 ms, so ratios 1.5, 1, 2, 2, 2, 3; their median is 2.
    a = _point(0.001, [0.001, 0.002, 0.001, 0.001, 0.002, 0.002])
    b = _point(0.002, [0.004, 0.004, 0.004, 0.004, 0.006, 0.006])
    # A point whose samples do not split into three passes is left out.
    odd = _point(0.001, [0.009] * 7)
    profile = replace(synthetic_profile(), step_points=(a, b, odd))
    got = stretch_paces(profile)
    assert got == pytest.approx((0.5, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5))
    # No usable point (an older or hand-made profile): the profile's own pace alone.
    assert stretch_paces(synthetic_profile()) == (1.0,)


def test_a_profile_without_points_gives_the_plain_prediction(tmp_path: Path) -> None:
    path = write_profile(tmp_path / "p.json")
    plain = _simulate(path, CHAT, 1, 1, 2, simulated=False)
    assert stretched_p90s(path, CHAT, 1, 1, 2) == (plain.ttft.p90, plain.itl.p90)


def test_stretched_rounds_replace_the_predicted_p90s(tmp_path: Path) -> None:
    run = _run(tmp_path, 2, later_profiles=True)
    slow = _point(0.002, [0.002, 0.002, 0.002, 0.002, 0.006, 0.006])
    for name in ("profile-demo.json", "profile-demo-round2.json"):
        prof = synthetic_profile(execute=(0.002 * (1 + name.count("round")), 1e-5, 0, 0, 0, 0, 0))
        replace(prof, step_points=(slow,)).save(run / name)
    (row,) = resimulate(run, cores=2, stretches=True)
    want = [stretched_p90s(run / n, CHAT, 1, 1, 2)
            for n in ("profile-demo.json", "profile-demo-round2.json")]  # fmt: skip
    assert row.predicted_ttft_rounds == tuple(t for t, _ in want)
    assert row.predicted_itl_rounds == tuple(i for _, i in want)
    # One pass at 3x the others: the pooled tail is slower than the plain prediction.
    (plain,) = resimulate(run, cores=2)
    assert row.predicted_itl_rounds[0] > plain.predicted_itl_rounds[0]
