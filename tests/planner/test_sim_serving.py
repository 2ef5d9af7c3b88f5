"""The simulator's serving model: router event loops as FIFO servers of measured CPU, the
worker's per-request CPU, and the machine's measured variability, each on hand-computed times."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.engine.config import SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim.profile import ServingCost
from tandem.planner.cores import CoreShare, shared_seconds
from tandem.planner.events import EventLoop
from tandem.planner.sim_kv import KVFabric
from tandem.planner.sim_router import RouterLoop
from tandem.planner.sim_worker import SimWorker, WorkerCallbacks
from tandem.planner.simulator import (
    Deployment,
    MachinePace,
    SimOptions,
    run_simulation,
    simulate,
)
from tandem.planner.workload import Arrival, Lengths, Workload
from tandem.prefill.hooks import PrefillHooks

# 10 ms per step + 0.1 ms per token.
BASE = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.0)
PROFILE = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0), serving=BASE)


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


def test_a_loop_charges_the_wake_up_only_to_work_that_finds_it_idle() -> None:
    # 40 % of each item's 1 ms is waking the loop: the first of three items at t=0 pays it,
    # the two that queue behind it ride the running loop (0.6 ms each); an item at t=5 ms
    # finds the loop asleep again and pays the whole 1 ms.
    loop = EventLoop()
    router = RouterLoop(loop, wake_share=0.4)
    for _ in range(3):
        router.serve(0.001, 0.0, lambda: None)
    assert router.busy_until == pytest.approx(0.0022)
    loop.at(0.005, lambda: router.serve(0.001, 0.0, lambda: None))
    loop.run()
    assert router.busy_until == pytest.approx(0.006)
    assert router.busy_seconds == pytest.approx(0.0032)


def test_a_busy_loop_takes_items_in_turns_and_the_first_of_each_turn_pays_it() -> None:
    # 40 % of each item's 1 ms is the loop's turn. One at t=0 wakes the loop (a turn from 0 to
    # 1 ms); one at 0.5 ms finds that turn begun and waits for the next, from 1 ms, which it
    # pays (1 ms, to 2 ms); one at 0.7 ms rides that turn (0.6 ms, to 2.6 ms); one at 1.5 ms
    # finds it begun too and pays the turn after it (1 ms, to 3.6 ms).
    loop = EventLoop()
    router = RouterLoop(loop, wake_share=0.4)
    for t in (0.0, 0.0005, 0.0007, 0.0015):
        loop.at(t, lambda: router.serve(0.001, 0.0, lambda: None))
    loop.run()
    assert router.busy_until == pytest.approx(0.0036)
    assert router.busy_seconds == pytest.approx(0.0036)


class _Busy:
    """Another thread on the shared cores, busy until ``busy_until``."""

    def __init__(self, busy_until: float) -> None:
        self.busy_until = busy_until


def test_a_loop_waking_onto_full_cores_waits_the_run_queue_first() -> None:
    # One core, 2 ms of run-queue wait. Another thread holds the core until t=10 ms: an item
    # at t=0 finds the loop idle and the core taken, so its 1 ms starts at 2 ms, and at half
    # speed beside that thread (processor sharing): done at 4 ms. The item queued behind it
    # rides the running loop (no wait): 2 ms more at half speed, 6 ms. At t=20 ms the core is
    # free: an item there runs at once, 1 ms.
    loop = EventLoop()
    share = CoreShare(1, 1, lambda _t: 1.0, run_queue_wait=0.002)
    share.loops.append(_Busy(0.010))
    router = RouterLoop(loop, share)
    share.loops.append(router)
    router.serve(0.001, 0.0, lambda: None)
    assert router.busy_until == pytest.approx(0.004)
    router.serve(0.001, 0.0, lambda: None)
    assert router.busy_until == pytest.approx(0.006)
    loop.at(0.020, lambda: router.serve(0.001, 0.0, lambda: None))
    loop.run()
    assert router.busy_until == pytest.approx(0.021)
    # Not modelled (0, what older profiles load with), or the cores unshared: no wait.
    assert CoreShare(1, 1, lambda _t: 1.0).wake_wait(0.0, router) == 0.0
    assert CoreShare(None, 1, lambda _t: 1.0, run_queue_wait=0.002).wake_wait(0.0, router) == 0.0


@pytest.mark.parametrize(
    ("busy_until", "first_token", "at_worker"), [(0.0, 0.010, 0.010), (0.003, 0.014, 0.012)]
)
def test_a_worker_waking_for_a_request_waits_for_a_core_at_each_thread(
    busy_until: float, first_token: float, at_worker: float
) -> None:
    # One core, 2 ms of run-queue wait, a 10 ms step. Another thread holds the core until
    # 3 ms: the worker's idle HTTP thread wakes for the request at t=0 onto the full core and
    # hands it over at 2 ms; the idle engine thread it wakes finds the core still taken and
    # starts the step at 4 ms, alone: the token at 14 ms, 12 ms after the worker had it. With
    # the core free, neither waits: the token at 10 ms.
    loop = EventLoop()
    prof = synthetic_profile(execute=(0.01, 0, 0, 0, 0, 0, 0), serving=BASE)
    share = CoreShare(1, 1, lambda _t: 1.0, run_queue_wait=0.002)
    share.loops.append(_Busy(busy_until))
    tokens: list[float] = []
    callbacks = WorkerCallbacks(lambda *_: tokens.append(loop.now), lambda *_: None,
                                lambda *_: None)  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    fabric = KVFabric(loop, lambda n: 0.0, prof.engine.block_bytes)
    w = SimWorker(loop, "w", Role.COLOCATED, prof.step, config, 64, 16, prof.model.sim_token_ids,
                  fabric, callbacks, share)  # fmt: skip
    share.workers = [w]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    w.submit(Request("r0", list(range(1, 9)), params, eos_token_ids=frozenset([257]),
                     block_size=16, max_tokens=1))  # fmt: skip
    loop.run()
    assert tokens == pytest.approx([first_token])
    assert w.first_token_seconds == pytest.approx([at_worker])  # from the engine's intake
    w.kv.check_integrity()


def test_the_run_queue_wait_delays_a_lone_request_only_on_full_cores() -> None:
    # One request alone on a colocated worker: with cores to spare (8) nothing waits; on one
    # core a thread on its first token's path wakes while the core is taken (the router's loop
    # still streaming, or the engine's next step): its TTFT grows by one wait of 3 ms.
    w = Workload(rate=1.0, isl=Lengths(16), osl=Lengths(4), num_requests=1)
    serving = replace(BASE, run_queue_wait=0.003, router_token_cpu=1e-4)

    def ttft(cost: ServingCost, cores: int) -> float:
        sim = run_simulation(replace(PROFILE, serving=cost), w, Deployment(0, 1),
                             SimOptions(variability=False, shared_cores=cores))  # fmt: skip
        return sim.result.traces[0].ttft

    assert ttft(serving, 8) == pytest.approx(ttft(replace(serving, run_queue_wait=0.0), 8))
    extra = ttft(serving, 1) - ttft(replace(serving, run_queue_wait=0.0), 1)
    assert extra == pytest.approx(0.003)


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


def test_a_prefill_worker_pays_its_side_of_a_transfer_after_the_first_token() -> None:
    # 1P1D: the prefill worker's CPU per request is 5 ms of handling (the colocated figure) and
    # 3 ms more for serving the decode worker's pull, which comes after its first token: the
    # step making that token pays 5 ms; serving the pull delays no step of a worker that idles
    # through it (a lone request: its only step was over before the pull).
    cost = replace(BASE, worker_request_cpu=0.005, prefill_request_cpu=0.008)
    assert (cost.request_cpu(Role.PREFILL), cost.transfer_cpu(Role.PREFILL)) == pytest.approx(
        (0.005, 0.003)
    )
    assert cost.transfer_cpu(Role.DECODE) == cost.transfer_cpu(Role.COLOCATED) == 0.0
    one = Workload(rate=1, isl=Lengths(32), osl=Lengths(3), num_requests=1)
    dep = Deployment(1, 1)
    base = run_simulation(PROFILE, one, dep)
    run = run_simulation(replace(PROFILE, serving=cost), one, dep)
    ((b,), (t,)) = base.result.traces, run.result.traces
    assert t.ttft == pytest.approx(b.ttft + 0.005)
    prefill = next(w for w in run.workers if w.role is Role.PREFILL)
    base_prefill = next(w for w in base.workers if w.role is Role.PREFILL)
    assert prefill.busy_seconds == pytest.approx(base_prefill.busy_seconds + 0.005)
    assert prefill.owed == 0.0


def test_serving_a_pull_delays_only_the_steps_that_start_while_it_runs() -> None:
    # Stop-25 validation run: charging a pull's 3.9 ms to the prefill worker's next step,
    # however long after, put every light-load 1P1D TTFT ~4 ms high (+28 %, +29 %).
    loop = EventLoop()
    prof = synthetic_profile(execute=(0.01, 0, 0, 0, 0, 0, 0), serving=BASE)
    fabric = KVFabric(loop, lambda n: 0.0, prof.engine.block_bytes)
    ignore = WorkerCallbacks(lambda *_: None, lambda *_: None, lambda *_: None)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    w = SimWorker(loop, "p", Role.PREFILL, prof.step, config, 64, 16, prof.model.sim_token_ids,
                  fabric, ignore, transfer_overhead=0.003)  # fmt: skip
    assert isinstance(w.hooks, PrefillHooks)
    serve = w.hooks.connector.on_served
    seen: list[float] = []
    serve()  # at t = 0: 3 ms of serving ahead
    loop.at(0.001, lambda: seen.append(w.owed))  # 2 ms of it left
    loop.at(0.001, serve)  # a second pull queues behind the first: until 6 ms
    loop.at(0.002, lambda: seen.append(w.owed))
    loop.at(0.007, lambda: seen.append(w.owed))  # done while idle: nothing owed
    loop.run()
    assert seen == pytest.approx([0.002, 0.004, 0.0])


def test_streaming_cpu_slows_steps_only_where_it_takes_a_needed_core() -> None:
    # Four streams at once on one colocated worker; streaming a token costs its HTTP thread
    # 20 ms (longer than a 10.4 ms decode step), so that thread is always busy while the
    # streams run. With a core of its own (2 cores, 1 engine thread) the steps are untouched;
    # on 1 shared core each decode step is stretched 2x (engine + streaming thread); with no
    # shared cores (an accelerator) streaming never slows a step.
    w = Workload(rate=1e6, isl=Lengths(16), osl=Lengths(6), num_requests=4,
                 arrival=Arrival.CONSTANT)  # fmt: skip
    rows = replace(PROFILE, serving=replace(BASE, row_seconds=0.02))

    def run(profile, cores: int | None) -> tuple[int, float, float]:  # noqa: ANN001 - a Profile
        """(steps, the worker's busy seconds, first token to last over all the requests)."""
        sim = run_simulation(profile, w, Deployment(0, 1),
                             SimOptions(shared_cores=cores, variability=False))  # fmt: skip
        (worker,) = sim.workers
        traces = sim.result.traces
        span = max(t.last_token for t in traces) - min(t.first_token for t in traces)
        return worker.steps, worker.busy_seconds, span

    steps, busy, _ = run(PROFILE, None)
    # The first request's prefill (11.6 ms), the other three's with its decode, four decode
    # steps of 10.4 ms and a last of three rows.
    assert steps == 7
    for cores in (None, 2):
        got = run(rows, cores)
        assert got[:2] == (7, pytest.approx(busy))
        # But the tokens wait for the streaming thread, a FIFO of 20 ms a row: the 24 rows
        # leave one every 20 ms from the prefill step's end, whatever the steps do meanwhile.
        assert got[2] == pytest.approx(23 * 0.02)
    # One core: every step after the first shares it with the streaming thread, at half speed.
    assert run(rows, 1)[1] == pytest.approx(busy + (busy - 0.0116), rel=0.05)


def test_a_steps_rows_wake_the_streaming_thread_once() -> None:
    # The same four streams with 2 ms a row (the streaming thread idles between steps): a
    # step's rows arrive in one hand-over, so with half of a row's cost its wake-up, a step of
    # n rows costs the thread 2 ms + (n - 1) x 1 ms instead of n x 2 ms.
    w = Workload(rate=1e6, isl=Lengths(16), osl=Lengths(6), num_requests=4,
                 arrival=Arrival.CONSTANT)  # fmt: skip

    # The last step has three rows (steps as in the test above): 6 ms of streaming alone,
    # 2 + 1 + 1 = 4 ms with the wake-up paid once, its rows leaving evenly over that burst.
    spans = {}
    for share in (0.0, 0.5):
        serving = replace(BASE, row_seconds=0.002, row_wake_share=share)
        sim = run_simulation(replace(PROFILE, serving=serving), w, Deployment(0, 1),
                             SimOptions(variability=False))  # fmt: skip
        ends = sorted(t.last_token for t in sim.result.traces)
        spans[share] = ends[-1] - ends[-2]
    assert spans[0.0] == pytest.approx(0.006 / 3) and spans[0.5] == pytest.approx(0.004 / 3)


def test_shared_cores_are_processor_shared_over_the_overlap_only() -> None:
    ms = 1e-3
    # Nothing beside it, or no more threads than cores: the step's own time.
    assert shared_seconds(7 * ms, 1, 2, []) == pytest.approx(7 * ms)
    assert shared_seconds(7 * ms, 1, 2, [(0.3 * ms, 1)]) == pytest.approx(7 * ms)
    # Three threads on two cores for 0.3 ms (each at 2/3): the step loses 0.1 ms, not a third
    # of its 7 ms as a ratio taken at its start would have it.
    assert shared_seconds(7 * ms, 1, 2, [(0.3 * ms, 1), (0.3 * ms, 1)]) == pytest.approx(7.1 * ms)
    # One core: half speed while the other thread runs (4 ms: 2 ms done), then full speed.
    assert shared_seconds(10 * ms, 1, 1, [(4 * ms, 1)]) == pytest.approx(12 * ms)
    # The other outlasts the step: half speed throughout.
    assert shared_seconds(10 * ms, 1, 1, [(80 * ms, 1)]) == pytest.approx(20 * ms)
    # Two engine threads on two cores beside a worker of two threads ending at 1 ms: half
    # speed for 1 ms (0.5 ms done), then the remaining 4.5 ms alone.
    assert shared_seconds(5 * ms, 2, 2, [(1 * ms, 2)]) == pytest.approx(5.5 * ms)
    # More threads than cores and nothing else: stretched by threads / cores.
    assert shared_seconds(5 * ms, 4, 2, []) == pytest.approx(10 * ms)


def test_the_clients_cpu_competes_only_when_it_shares_the_cores() -> None:
    loop = EventLoop()
    client = RouterLoop(loop)
    client.spend(0.002)
    client.spend(0.001)
    assert client.busy_until == pytest.approx(0.003) and client.busy_seconds == pytest.approx(0.003)
    loop.run()  # spend() schedules nothing
    # One colocated worker on one core; the client spends 20 ms per token it receives, so it
    # is busy beside every later step: with the client on the cores the ITL roughly doubles,
    # elsewhere (or with no shared cores) it is untouched.
    w = Workload(rate=1, isl=Lengths(16), osl=Lengths(6), num_requests=1)
    heavy = replace(PROFILE, serving=replace(BASE, client_token_cpu=0.02))

    def itl(profile, cores: int | None, client: bool) -> float:  # noqa: ANN001 - a Profile
        options = SimOptions(shared_cores=cores, variability=False, client_shares_cores=client)
        return simulate(profile, w, Deployment(0, 1), options).itl.p50

    base = itl(PROFILE, 1, False)
    assert itl(heavy, 1, False) == pytest.approx(base)
    assert itl(heavy, None, True) == pytest.approx(base)
    assert itl(heavy, 1, True) > 1.8 * base


class _Step:
    """What CoreShare reads of a worker: its step's end and its streaming thread's."""

    def __init__(self, busy_until: float, role: Role = Role.COLOCATED) -> None:
        self.busy, self.busy_until, self.shell_busy_until = True, busy_until, 0.0
        self.serving_until = 0.0
        self.role = role

    def extend(self, seconds: float) -> None:
        self.busy_until += seconds


def test_a_burst_beside_a_running_step_lengthens_it_by_its_share() -> None:
    from tandem.planner.cores import CoreShare

    ms = 1e-3

    def after_burst(cores: int | None, start: float, end: float) -> float:
        share = CoreShare(cores, 1, lambda _t: 1.0)
        step = _Step(10 * ms)  # began alone at 0, ends at 10 ms
        share.workers = [step]  # type: ignore[list-item]
        share.burst(start, end, 1, object())
        return step.busy_until

    # One core: half speed over [2, 6) ms loses 2 ms of the step's work.
    assert after_burst(1, 2 * ms, 6 * ms) == pytest.approx(12 * ms)
    # A burst that outlasts it: the 8 ms left run at half speed.
    assert after_burst(1, 2 * ms, 30 * ms) == pytest.approx(18 * ms)
    # Two cores, two threads: no one waits.
    assert after_burst(2, 2 * ms, 6 * ms) == pytest.approx(10 * ms)
    # No shared cores (an accelerator): nothing changes.
    assert after_burst(None, 2 * ms, 6 * ms) == pytest.approx(10 * ms)


def test_lengthened_follows_the_neighbours_as_they_end() -> None:
    from tandem.planner.cores import lengthened

    ms = 1e-3
    # Nothing else running, one core: 8 ms left, a 4 ms burst takes half of it: 2 ms more.
    assert lengthened(8 * ms, 1, 1, [], 4 * ms, 1) == pytest.approx(10 * ms)
    # Two cores, a streaming thread with 0.1 ms to go, a decode step of 5 ms starting beside:
    # three threads want two cores for 0.1 ms only, so the step loses 0.1 / 3 ms, not 5 / 3.
    assert lengthened(10 * ms, 1, 2, [(0.1 * ms, 1)], 5 * ms, 1) == pytest.approx(
        10 * ms + 0.1 * ms / 3
    )
    # Two neighbours for the first 4 ms (the step at 2/3 speed, 8.67 ms of work left); a
    # 10 ms burst: 1/2 speed while they run, full speed after; 0.67 ms left at 10 ms.
    got = lengthened(10 * ms, 1, 2, [(4 * ms, 1), (4 * ms, 1)], 10 * ms, 1)
    assert got == pytest.approx(10 * ms + (4 * 2 / 3 + 6 - 4 / 2 - 6) * ms)
    # Cores to spare throughout: nothing changes.
    assert lengthened(10 * ms, 1, 4, [(4 * ms, 1)], 10 * ms, 1) == pytest.approx(10 * ms)


def test_a_burst_beside_a_step_and_a_short_thread_costs_only_the_overlap() -> None:
    # Two cores: a prefill step running until 10 ms, a streaming thread busy until 0.1 ms, and
    # a decode step from 0 to 5 ms. Counting the thread for the decode step's whole length
    # put the prefill at 2/3 speed for 5 ms (1.67 ms late); it is 1/3 ms late per 1 ms of it.
    from tandem.planner.cores import CoreShare

    ms = 1e-3
    share = CoreShare(2, 1, lambda _t: 1.0)
    step = _Step(10 * ms)
    shell = _Step(0.0)
    shell.busy, shell.shell_busy_until = False, 0.1 * ms
    share.workers = [step, shell]  # type: ignore[list-item]
    share.burst(0.0, 5 * ms, 1, object())
    assert step.busy_until == pytest.approx(10 * ms + 0.1 * ms / 3)


def test_a_loop_burst_while_steps_hold_every_core_comes_whole_out_of_the_prefill() -> None:
    # Two cores, a prefill step and a decode step running: the router loop's 1 ms burst is
    # charged whole to the prefill (the kernel wakes it onto the prefill's core:
    # benchmarks/plan_contention.py), not shared between the two.
    ms = 1e-3
    loop = EventLoop()
    share = CoreShare(2, 1, lambda _t: 1.0)
    prefill, decode = _Step(50 * ms, Role.PREFILL), _Step(5 * ms, Role.DECODE)
    share.workers = [decode, prefill]  # type: ignore[list-item]
    router = RouterLoop(loop, share)
    share.loops.append(router)
    share.burst(1 * ms, 2 * ms, 1, router)
    assert prefill.busy_until == pytest.approx(51 * ms)
    assert decode.busy_until == pytest.approx(5 * ms)
    # No prefill among them: the step that ends last pays.
    a, b = _Step(8 * ms), _Step(6 * ms)
    share.workers = [a, b]  # type: ignore[list-item]
    share.burst(1 * ms, 2 * ms, 1, router)
    assert (a.busy_until, b.busy_until) == (pytest.approx(9 * ms), pytest.approx(6 * ms))
    # A core to spare: processor sharing, and two threads on two cores lose nothing.
    alone = _Step(50 * ms, Role.PREFILL)
    share.workers = [alone]  # type: ignore[list-item]
    share.burst(1 * ms, 2 * ms, 1, router)
    assert alone.busy_until == pytest.approx(50 * ms)
    # A burst that is not a loop's (a worker's streaming thread) is shared as before: three
    # threads on two cores for 1 ms, each step 1/3 ms late.
    p2, d2 = _Step(50 * ms, Role.PREFILL), _Step(5 * ms, Role.DECODE)
    share.workers = [p2, d2]  # type: ignore[list-item]
    share.burst(1 * ms, 2 * ms, 1, object())
    assert p2.busy_until == pytest.approx(50 * ms + ms / 3)
    assert d2.busy_until == pytest.approx(5 * ms + ms / 3)


def test_a_prefill_worker_serving_a_pull_holds_a_core_for_every_other_thread() -> None:
    # One core, 2 ms run-queue wait. A prefill worker idle but for a pull it serves until
    # t=10 ms: the router's loop waking at 0 finds the core taken (waits 2 ms) and its 1 ms
    # item runs at half speed beside the pull (2 ms): done at 4 ms. The worker itself does
    # not count its own pull (its step waits for it instead: SimWorker.owed).
    ms = 1e-3
    loop = EventLoop()
    share = CoreShare(1, 1, lambda _t: 1.0, run_queue_wait=2 * ms)
    worker = _Step(0.0)
    worker.busy, worker.serving_until = False, 10 * ms
    share.workers = [worker]  # type: ignore[list-item]
    router = RouterLoop(loop, share)
    share.loops.append(router)
    router.serve(1 * ms, 0.0, lambda: None)
    assert router.busy_until == pytest.approx(4 * ms)
    assert share.wake_wait(5 * ms, worker) == 0.0
    assert share.burst_seconds(worker, 5 * ms, 1 * ms) == pytest.approx(1 * ms)
    # Once the pull is served, nothing holds the core.
    assert share.wake_wait(10 * ms, router) == 0.0
    assert share.burst_seconds(router, 10 * ms, 1 * ms) == pytest.approx(1 * ms)
