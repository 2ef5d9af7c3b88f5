"""The simulator's serving model: router event loops as FIFO servers of measured CPU, the
worker's per-request CPU, and the machine's measured variability, each on hand-computed times."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.engine.sim.profile import ServingCost
from tandem.planner.events import EventLoop
from tandem.planner.sim_router import RouterLoop
from tandem.planner.simulator import Deployment, MachinePace, SimOptions, run_simulation, simulate
from tandem.planner.workload import Arrival, Lengths, Workload

# 10 ms per step + 0.1 ms per token.
BASE = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.0)
PROFILE = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0), serving=BASE)


def test_a_router_loop_serves_its_work_first_come_first_served() -> None:
    loop = EventLoop()
    router = RouterLoop(loop)
    done: list[tuple[str, float]] = []
    # Three jobs at t=0 of 1 ms CPU each within 2.5 ms latencies: the CPU queues, the rest of
    # each latency is a plain delay after the job's CPU.
    for name in "abc":
        router.serve(0.001, 0.0025, lambda n=name: done.append((n, loop.now)))
    assert router.busy and router.busy_until == pytest.approx(0.003)
    loop.run()
    assert [n for n, _ in done] == ["a", "b", "c"]
    assert [t for _, t in done] == pytest.approx([0.0025, 0.0035, 0.0045])
    assert router.busy_seconds == pytest.approx(0.003) and not router.busy


def test_router_cpu_queues_placements_behind_each_other() -> None:
    # Two requests 1 us apart onto two colocated workers (round robin: one each). Placing one
    # costs the router 4 ms of CPU within its 4 ms latency, so the second is placed 4 ms after
    # the first, where a plain latency would place it 1 us after; one router loop per request
    # (two routers) places both at once again.
    w = Workload(rate=1e6, isl=Lengths(16), osl=Lengths(2), num_requests=2,
                 arrival=Arrival.CONSTANT)  # fmt: skip
    dep = Deployment(0, 2, policy="round-robin")
    latency = replace(BASE, request_seconds=0.004)
    cpu = replace(latency, router_request_cpu=0.004)

    def ttfts(serving: ServingCost, d: Deployment = dep) -> list[float]:
        r = run_simulation(replace(PROFILE, serving=serving), w, d, SimOptions(variability=False))
        return [t.ttft for t in sorted(r.result.traces, key=lambda t: t.arrival)]

    free, queued = ttfts(latency), ttfts(cpu)
    assert free[0] == pytest.approx(queued[0])
    assert free[1] == pytest.approx(free[0])  # both placed at once: each on its own worker
    assert queued[1] + 1e-6 == pytest.approx(queued[0] + 0.004)  # TTFT counts from arrival
    assert ttfts(cpu, replace(dep, routers=2))[1] == pytest.approx(free[1])
    with pytest.raises(ValueError, match="at least one router"):
        Deployment(0, 1, routers=0)


def test_a_workers_per_request_cpu_lengthens_its_next_step() -> None:
    one = Workload(rate=1, isl=Lengths(32), osl=Lengths(3), num_requests=1)
    base = run_simulation(PROFILE, one, Deployment(0, 1)).result.traces[0]
    owed = replace(PROFILE, serving=replace(BASE, worker_request_cpu=0.005))
    (t,) = run_simulation(owed, one, Deployment(0, 1)).result.traces
    assert t.ttft == pytest.approx(base.ttft + 0.005)  # the prefill step pays it, once
    assert t.itl == pytest.approx(base.itl)


def test_machine_pace_is_seeded_and_constant_within_a_window() -> None:
    pace = MachinePace((0.5, 1.0, 2.0), seconds=0.01, seed=3)
    again = MachinePace((0.5, 1.0, 2.0), seconds=0.01, seed=3)
    factors = [pace.at(i * 0.001) for i in range(100)]
    assert factors == [again.at(i * 0.001) for i in range(100)]
    assert all(f in (0.5, 1.0, 2.0) for f in factors)
    assert all(len(set(factors[i : i + 10])) == 1 for i in range(0, 100, 10))
    assert len(set(factors)) > 1
    assert MachinePace((), 0.01, 0).at(5.0) == 1.0
    assert MachinePace((2.0,), 0.0, 0).at(5.0) == 1.0  # no window length: no variability


def _sim(profile, w: Workload, options: SimOptions) -> dict:  # noqa: ANN001 - a Profile
    out = simulate(profile, w, Deployment(0, 1), options).to_dict()
    out.pop("wall_s")
    return out


def test_variability_is_drawn_from_the_measured_spreads_and_can_be_turned_off() -> None:
    spread = replace(BASE, request_spread=(0.003, 0.009), pace_spread=(1.0, 3.0),
                     pace_seconds=0.02)  # fmt: skip
    prof = replace(PROFILE, serving=spread)
    w = Workload(rate=20, isl=Lengths(16), osl=Lengths(8), num_requests=200)
    on = _sim(prof, w, SimOptions(seed=1))
    assert on == _sim(prof, w, SimOptions(seed=1))
    assert on != _sim(prof, w, SimOptions(seed=2))
    off = _sim(prof, w, SimOptions(seed=1, variability=False))
    assert off == _sim(PROFILE, w, SimOptions(seed=1))
    assert on["ttft_s"]["p90"] > off["ttft_s"]["p90"]
    assert on["itl_s"]["p90"] > off["itl_s"]["p90"]
    # A first token's serving is 3 or 9 ms where it is 3 ms without the spread (2 + 1): the
    # slow draws alone put the p90 at least 6 ms above the steady median.
    assert on["ttft_s"]["p90"] - off["ttft_s"]["p50"] >= 0.006


def test_each_role_pays_its_own_measured_request_cpu() -> None:
    from tandem.engine.role import Role

    cost = replace(BASE, worker_request_cpu=0.002, decode_request_cpu=0.005)
    assert [cost.request_cpu(r) for r in (Role.COLOCATED, Role.PREFILL, Role.DECODE)] == [
        0.002, 0.002, 0.005,
    ]  # fmt: skip
    one = Workload(rate=1, isl=Lengths(32), osl=Lengths(3), num_requests=1)
    (base,) = run_simulation(PROFILE, one, Deployment(1, 1)).result.traces
    (t,) = run_simulation(replace(PROFILE, serving=cost), one, Deployment(1, 1)).result.traces
    # The prefill step pays 2 ms (the prefill's token is the client's first); decode's first
    # step pays 5 ms, which the first decode gap carries: ITL over 2 gaps grows by 2.5 ms.
    assert t.ttft == pytest.approx(base.ttft + 0.002)
    assert t.itl == pytest.approx(base.itl + 0.0025)
