"""`tandem plan` on hand-made profiles whose answers were worked out by hand (constant arrivals,
fixed lengths, round-robin placement, no serving or transfer latency), plus its CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_profiles import synthetic_profile, write_profile

from tandem.planner.cli import main as plan_main
from tandem.planner.search import SLO, Planner
from tandem.planner.simulator import Deployment
from tandem.planner.workload import Arrival, Lengths, Workload

RR = Deployment(policy="round-robin")


def test_ttft_bound_prompts_need_three_prefill_workers_and_one_decode() -> None:
    """400-token prompts at 50/s, 10 ms + 0.1 ms/token per step, budget 512.

    A prompt takes 50 ms on a prefill worker. Round robin gives each of P workers a prompt every
    20P ms: P = 3 never queues (TTFT = 50 ms exactly); P = 2 would need 25 prompts/s per worker,
    but even full 512-token steps (61.2 ms) do 20.9/s: the queue grows. Decode: ~5 requests in
    flight make 10.5 ms steps; a request's ITL is that plus its first gap over 10 gaps, about
    12 ms < 15 ms, so one decode worker. Colocated workers put a 50 ms prefill into their decode
    batches every few steps: ITL misses at 3 and 4 workers.
    """
    profile = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0), transfer=(0.0, 0.0),
                                max_num_batched_tokens=512, max_model_len=1024)  # fmt: skip
    w = Workload(rate=50, isl=Lengths(400), osl=Lengths(11), num_requests=500,
                 arrival=Arrival.CONSTANT)  # fmt: skip
    plan = Planner(profile, w, SLO(ttft_p90=0.1, itl_p90=0.015), RR, max_workers=8).plan()
    assert plan.best is not None
    assert (plan.best.deployment.prefill, plan.best.deployment.decode) == (3, 1)
    assert plan.best.result.ttft.p90 == pytest.approx(0.05)
    assert 0.0105 < plan.best.result.itl.p90 < 0.0135
    tried = {c.deployment.label: c for c in plan.tried}
    assert not tried["2P1D"].meets and tried["2P1D"].ttft_ratio > 5
    assert not tried["4 colocated"].meets and tried["4 colocated"].itl_ratio > 1
    assert plan.best_colocated is not None and plan.best_colocated.deployment.workers == 5


def test_itl_bound_decode_needs_two_workers_and_cheap_prefill_favours_colocated() -> None:
    """200-token prompts, 64-token answers at 20/s; 5 ms + 0.1 ms/token + 0.5 ms/row per step.

    Decode of b sequences takes 5 + 0.6b ms and each worker holds b = (20/D) x 63 x step(b)
    (Little's law): D = 1 -> b = 26, 20.5 ms steps (ITL misses 12.5 ms); D = 2 -> b = 5,
    8 ms steps. A 200-token prefill is 25.5 ms, every 50 ms: one prefill worker, TTFT 25.5 ms.
    So the split is 1P2D. But a prefill costs a colocated worker only ~20 ms of one step, about
    5 times in a request's life: ~1.6 ms of ITL over 8 ms, so 2 colocated workers meet the SLO
    too, with fewer workers: the plan is colocated.
    """
    profile = synthetic_profile(execute=(0.005, 1e-4, 5e-4, 0, 0, 0, 0), transfer=(0.0, 0.0),
                                max_model_len=1024)  # fmt: skip
    w = Workload(rate=20, isl=Lengths(200), osl=Lengths(64), num_requests=400,
                 arrival=Arrival.CONSTANT)  # fmt: skip
    plan = Planner(profile, w, SLO(ttft_p90=0.2, itl_p90=0.0125), RR, max_workers=8).plan()
    dis = plan.best_disaggregated
    assert dis is not None and (dis.deployment.prefill, dis.deployment.decode) == (1, 2)
    assert dis.result.ttft.p90 == pytest.approx(0.0255)
    assert 0.0075 < dis.result.itl.p90 < 0.009
    tried = {c.deployment.label: c for c in plan.tried}
    assert tried["1P1D"].itl_ratio > 1.5
    assert plan.best is plan.best_colocated
    assert plan.best is not None and plan.best.deployment.label == "2 colocated"


def test_cli_prints_the_plan_as_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_profile(tmp_path / "p.json", execute=(0.01, 1e-4, 0, 0, 0, 0, 0),
                         transfer=(0.0, 0.0), max_num_batched_tokens=512,
                         max_model_len=1024)  # fmt: skip
    args = ["--profile", str(path), "--isl", "400", "--osl", "11", "--rate", "50",
            "--ttft-p90", "0.1", "--itl-p90", "0.015", "--arrival", "constant",
            "--requests", "500", "--max-workers", "8"]  # fmt: skip
    assert plan_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] is True
    assert out["prefill"] + out["decode"] <= 6
    assert set(out["predicted"]) >= {"ttft_p90", "itl_p90", "e2e_p90", "utilization"}
    assert out["predicted"]["ttft_p90"] <= 0.1 and out["predicted"]["itl_p90"] <= 0.015
    assert all(set(a) >= {"prefill", "decode", "workers", "meets_slo"} for a in out["alternatives"])
    # Prefix-aware placement herds on stale heartbeats here: colocated misses within 8.
    assert out["colocated_alternative"] is None
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "plan: " in text and "colocated alternative: " in text and "TTFT p90" in text


def test_an_infeasible_slo_is_said_plainly_with_the_closest_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = write_profile(tmp_path / "p.json", execute=(0.01, 1e-4, 0, 0, 0, 0, 0))
    args = ["--profile", str(path), "--isl", "100", "--osl", "10", "--rate", "5",
            "--ttft-p90", "0.001", "--itl-p90", "0.001", "--max-workers", "3",
            "--requests", "100"]  # fmt: skip
    assert plan_main(args) == 1
    text = capsys.readouterr().out
    assert "infeasible: no deployment of at most 3 workers meets the SLO." in text
    assert "closest miss: " in text
    assert plan_main([*args, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["feasible"] is False


def test_bad_arguments_are_errors_not_plans(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_profile(tmp_path / "p.json")
    base = ["--profile", str(path), "--osl", "10", "--rate", "5", "--ttft-p90", "1",
            "--itl-p90", "0.1"]  # fmt: skip
    assert plan_main([*base, "--isl", "300"]) == 2
    assert "does not fit max_model_len 256" in capsys.readouterr().err
    assert plan_main([*base, "--isl", "10", "--prefix-share", "1.5"]) == 2
    assert "prefix_share" in capsys.readouterr().err
    assert plan_main(["--profile", str(tmp_path / "none.json"), *base[2:], "--isl", "8"]) == 2
