"""The discrete-event simulator: exact times on hand-computed cases, determinism, the P/D path,
placement and KV accounting after every run."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.engine.sim.profile import ServingCost
from tandem.planner.simulator import Deployment, SimOptions, run_simulation, simulate
from tandem.planner.workload import Arrival, Lengths, Workload

SERVING = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.003)
# 10 ms per step + 0.1 ms per token; transfers 1 ms + 1 ns per byte (a block is 32 KiB).
PROFILE = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0), transfer=(0.001, 1e-9),
                            serving=SERVING)  # fmt: skip


def one_request(isl: int, osl: int) -> Workload:
    return Workload(rate=1, isl=Lengths(isl), osl=Lengths(osl), num_requests=1)


def assert_pools_clean(sim) -> None:  # noqa: ANN001 - a Simulation
    for w in sim.workers:
        w.kv.check_integrity()
        s = w.scheduler
        assert not (s.running or s.waiting or s.loading or s.pinned), w.engine_id
        assert w.pool.num_free_blocks == w.pool.num_blocks, w.engine_id


def test_one_colocated_request_has_the_hand_computed_times() -> None:
    sim = run_simulation(PROFILE, one_request(32, 3), Deployment(0, 1))
    (t,) = sim.result.traces
    # placed at 2 ms; prefill 10 + 3.2 ms -> 15.2 ms; token reaches the client 1 ms later.
    assert t.ttft == pytest.approx(0.0162)
    # two decode steps of 10.1 ms each
    assert t.e2e == pytest.approx(0.0162 + 2 * 0.0101)
    assert t.itl == pytest.approx(0.0101)
    assert t.path == "colocated" and t.num_tokens == 3
    # Inside the worker (its TTFT histogram's view): arrival at 2 ms to the token at 15.2 ms.
    first = sim.result.pools["colocated"].first_token
    assert (first.count, first.p90) == (1, pytest.approx(0.0132))
    # The steps' own seconds: the prefill's 13.2 ms and two decodes'.
    assert sim.result.pools["colocated"].engine_seconds == pytest.approx(0.0132 + 2 * 0.0101)
    assert_pools_clean(sim)


def test_engine_seconds_leave_out_the_serving_work_charged_to_steps() -> None:
    serving = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.003,
                          step_seconds=0.002, worker_request_cpu=0.004)  # fmt: skip
    profile = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0), serving=serving)
    sim = run_simulation(profile, one_request(32, 3), Deployment(0, 1))
    (w,) = sim.workers
    # Three steps, each 2 ms of overhead; the first also the request's 4 ms.
    assert w.busy_seconds == pytest.approx(0.0132 + 2 * 0.0101 + 3 * 0.002 + 0.004)
    assert sim.result.pools["colocated"].engine_seconds == pytest.approx(0.0132 + 2 * 0.0101)


def test_one_disaggregated_request_has_the_hand_computed_times() -> None:
    sim = run_simulation(PROFILE, one_request(32, 3), Deployment(1, 1))
    (t,) = sim.result.traces
    assert t.ttft == pytest.approx(0.0162)  # the prefill's first token, as in colocated
    # hand-off reaches decode at 15.2 + 3 = 18.2 ms; the pull of 2 blocks takes 1 ms + 65.5 us;
    # the connector wakes the idle decode engine at once; then 10.1 ms per decode step.
    admitted = 0.0152 + 0.003 + 0.001 + 2 * 32768e-9
    assert t.last_token == pytest.approx(admitted + 2 * 0.0101 + 0.001)
    assert t.itl == pytest.approx((t.last_token - t.first_token) / 2)
    assert t.path == "remote"
    assert sim.result.paths == {"remote": 1}
    # Inside each worker: the prefill's 13.2 ms; decode's from the hand-off's arrival (18.2 ms)
    # through the pull to its first decode step.
    pools = sim.result.pools
    assert (pools["prefill"].first_token.count, pools["prefill"].first_token.p90) == (
        1, pytest.approx(0.0132))  # fmt: skip
    assert pools["decode"].first_token.p90 == pytest.approx(admitted + 0.0101 - 0.0182)
    assert_pools_clean(sim)


def test_a_handoff_takes_the_routers_loop_after_the_first_token() -> None:
    """The router's part of a hand-off (``router_handoff_cpu``) runs on the request's loop
    after the prefill's token (0.5 ms of router CPU here), and admits the decode request once
    both that CPU and the hand-off's latency (3 ms, which holds it) have passed."""

    def run(handoff_cpu: float):  # noqa: ANN202 - a Simulation
        serving = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.003,
                              router_token_cpu=0.0005, router_handoff_cpu=handoff_cpu)  # fmt: skip
        profile = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0),
                                    transfer=(0.001, 1e-9), serving=serving)  # fmt: skip
        sim = run_simulation(profile, one_request(32, 3), Deployment(1, 1))
        assert_pools_clean(sim)
        return sim

    old, within, past = run(0.0), run(0.002), run(0.004)
    (t0,), (t1,), (t2,) = old.result.traces, within.result.traces, past.result.traces
    assert t0.ttft == t1.ttft == t2.ttft  # the prefill's first token is before the hand-off
    # 0 (a profile without the figure): admitted 3 ms after the hand-off, as before. 2 ms:
    # after the token's 0.5 ms, then max(2 ms of CPU, 3 ms): 0.5 ms later. 4 ms: 1.5 ms later.
    assert t1.last_token - t0.last_token == pytest.approx(0.0005)
    assert t2.last_token - t0.last_token == pytest.approx(0.0015)
    (loop,) = within.router.loops
    (loop0,) = old.router.loops
    assert loop.busy_seconds - loop0.busy_seconds == pytest.approx(0.002)


def test_a_handoff_draws_its_latency_from_the_measured_spread() -> None:
    """With variability, each hand-off takes a draw from ``handoff_spread`` (the profile's
    quantiles of the measured gap) in place of ``handoff_seconds``, on a stream of its own."""

    def last_token(serving: ServingCost, variability: bool = True) -> float:
        profile = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0),
                                    transfer=(0.001, 1e-9), serving=serving)  # fmt: skip
        sim = run_simulation(profile, one_request(32, 3), Deployment(1, 1),
                             SimOptions(seed=3, variability=variability))  # fmt: skip
        assert_pools_clean(sim)
        (t,) = sim.result.traces
        return t.last_token

    base = last_token(SERVING)
    # One quantile: every hand-off takes it, 6 ms where handoff_seconds says 3, or 1 ms.
    assert last_token(replace(SERVING, handoff_spread=(0.006,))) == pytest.approx(base + 0.003)
    assert last_token(replace(SERVING, handoff_spread=(0.001,))) == pytest.approx(base - 0.002)
    # Without variability the spread is not drawn.
    assert last_token(replace(SERVING, handoff_spread=(0.006,)), variability=False) == base
    # The requests' own draws do not move when a hand-off spread is added.
    w = Workload(rate=40, isl=Lengths(32), osl=Lengths(4), num_requests=60)
    drawn = replace(SERVING, request_spread=(0.002, 0.004, 0.009))

    def times(serving: ServingCost) -> list[tuple[float | None, float | None]]:
        prof = replace(PROFILE, serving=serving)
        traces = simulate(prof, w, Deployment(1, 1), SimOptions(seed=5)).traces
        return [(t.ttft, t.last_token) for t in traces]

    with_spread = replace(drawn, handoff_spread=(0.003,))  # the same 3 ms: only the stream differs
    assert times(with_spread) == times(drawn)
    assert len({ttft for ttft, _ in times(drawn)}) > 1


def test_the_simulator_is_deterministic_for_a_seed() -> None:
    w = Workload(rate=30, isl=Lengths(64, 0.5), osl=Lengths(16, 0.5), num_requests=200,
                 prefix_share=0.25, prefix_groups=3)  # fmt: skip
    dep = Deployment(1, 2)

    def run(seed: int) -> dict:
        out = simulate(PROFILE, w, dep, SimOptions(seed=seed)).to_dict()
        out.pop("wall_s")
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_every_pd_request_moves_its_kv_and_no_block_leaks() -> None:
    w = Workload(rate=40, isl=Lengths(100, 0.3), osl=Lengths(20, 0.3), num_requests=300)
    sim = run_simulation(PROFILE, w, Deployment(2, 3))
    r = sim.result
    assert r.completed == 300 and not r.overloaded
    assert r.paths == {"remote": 300}
    assert all(t.num_tokens == t.max_tokens for t in r.traces)
    assert set(r.pools) == {"prefill", "decode"}
    assert r.pools["prefill"].steps > 0 and r.pools["decode"].steps > 0
    assert_pools_clean(sim)


def test_short_prompts_prefill_on_decode_below_the_threshold() -> None:
    w = Workload(rate=20, isl=Lengths(40), osl=Lengths(8), num_requests=50)
    sim = run_simulation(PROFILE, w, Deployment(1, 1, local_prefill_threshold=64))
    assert sim.result.paths == {"local_below_threshold": 50}
    assert sim.result.pools["prefill"].steps == 0
    assert_pools_clean(sim)


def test_prefix_aware_placement_finds_more_cached_prefix_than_round_robin() -> None:
    w = Workload(rate=20, isl=Lengths(160), osl=Lengths(4), num_requests=200, prefix_share=0.8,
                 prefix_groups=4, arrival=Arrival.CONSTANT)  # fmt: skip

    def cached(policy: str) -> int:
        sim = run_simulation(PROFILE, w, Deployment(0, 4, policy=policy))
        assert_pools_clean(sim)
        return sum(t.num_cached_tokens for t in sim.result.traces)

    aware, rr = cached("prefix-aware"), cached("round-robin")
    # Round robin puts each group on every worker, so 4 groups x 4 workers miss once each;
    # prefix-aware keeps a group where it is cached.
    assert aware > rr
    assert aware >= (200 - 16) * 128


def test_an_overloaded_deployment_stops_early_and_never_looks_good() -> None:
    w = Workload(rate=500, isl=Lengths(200), osl=Lengths(50), num_requests=3000)
    r = simulate(PROFILE, w, Deployment(0, 1), SimOptions(max_in_flight=300))
    assert r.overloaded and r.completed < 3000
    assert math.isinf(r.ttft.p90) and math.isinf(r.e2e.p90)


def test_shared_cores_slow_steps_down_when_workers_outnumber_cores() -> None:
    w = Workload(rate=50, isl=Lengths(64), osl=Lengths(32), num_requests=200)
    own = simulate(PROFILE, w, Deployment(1, 2))
    shared = simulate(PROFILE, w, Deployment(1, 2), SimOptions(shared_cores=1))
    assert shared.itl.p50 > own.itl.p50 * 1.2
