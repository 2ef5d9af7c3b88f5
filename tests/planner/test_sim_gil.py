"""One GIL per simulated worker on shared cores: the HTTP thread's Python (streaming rows,
taking in requests) and the engine thread's steps take turns, on hand-computed times."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import synthetic_profile

from tandem.engine.config import SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim.profile import ServingCost
from tandem.planner.cores import CoreShare
from tandem.planner.events import EventLoop
from tandem.planner.metrics import RequestTrace
from tandem.planner.sim_kv import KVFabric
from tandem.planner.sim_worker import SimWorker, WorkerCallbacks
from tandem.planner.simulator import Deployment, SimOptions, run_simulation
from tandem.planner.workload import Arrival, Lengths, Workload

# 10 ms per step + 0.1 ms per token; no router or client CPU, so no loop takes a core.
BASE = ServingCost(request_seconds=0.002, token_seconds=0.001, handoff_seconds=0.0)
PROFILE = synthetic_profile(execute=(0.01, 1e-4, 0, 0, 0, 0, 0), serving=BASE)
FOUR = Workload(rate=1e6, isl=Lengths(16), osl=Lengths(6), num_requests=4,
                arrival=Arrival.CONSTANT)  # fmt: skip


def _run(
    serving: ServingCost, workload: Workload, cores: int | None
) -> tuple[SimWorker, list[RequestTrace]]:
    sim = run_simulation(replace(PROFILE, serving=serving), workload, Deployment(0, 1),
                         SimOptions(shared_cores=cores, variability=False))  # fmt: skip
    (worker,) = sim.workers
    return worker, list(sim.result.traces)


def test_a_lone_stream_is_timed_as_calibrated_with_or_without_the_gil() -> None:
    # The calibration's step_seconds is a lone stream's ITL beyond the grid's step: one row's
    # streaming included. Under the GIL the next step waits only for rows beyond that one, so
    # a lone request's TTFT and ITL are the same on shared cores (8: none is short) as on an
    # accelerator, where streaming runs beside the steps.
    one = Workload(rate=1.0, isl=Lengths(16), osl=Lengths(6), num_requests=1)
    serving = replace(BASE, step_seconds=0.003, row_seconds=0.002)
    w_acc, (acc,) = _run(serving, one, None)
    w_gil, (gil,) = _run(serving, one, 8)
    assert not w_acc.gil and w_gil.gil
    assert gil.ttft == pytest.approx(acc.ttft)
    assert gil.itl == pytest.approx(acc.itl)
    assert w_gil.busy_seconds == pytest.approx(w_acc.busy_seconds)


def test_under_the_gil_a_step_waits_for_the_rows_streamed_before_it() -> None:
    # Four streams at once, 2 ms of streaming a row: the first prefill (1 row), the other
    # three's with its decode (4 rows), four decode steps of 4 rows and a last of 3. Each of
    # the five steps after a 4-row step waits for 4 x 2 ms less the one row step_seconds
    # holds: 30 ms more engine-thread time, in the same 7 steps. On an accelerator none.
    serving = replace(BASE, row_seconds=0.002)
    w_acc, _ = _run(serving, FOUR, None)
    w_base, _ = _run(BASE, FOUR, None)
    w_gil, _ = _run(serving, FOUR, 8)
    assert w_acc.steps == w_gil.steps == 7
    assert w_acc.busy_seconds == pytest.approx(w_base.busy_seconds)
    assert w_gil.busy_seconds == pytest.approx(w_base.busy_seconds + 5 * 0.006)


def _worker(loop: EventLoop, cores: CoreShare | None, request_cpu: float) -> SimWorker:
    callbacks = WorkerCallbacks(lambda *_: None, lambda *_: None, lambda *_: None)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    fabric = KVFabric(loop, lambda n: 0.0, PROFILE.engine.block_bytes)
    w = SimWorker(loop, "w", Role.COLOCATED, PROFILE.step, config, 64, 16,
                  PROFILE.model.sim_token_ids, fabric, callbacks, cores,
                  request_overhead=request_cpu)  # fmt: skip
    if cores is not None:
        cores.workers = [w]
    return w


def _request(rid: str) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return Request(rid, list(range(1, 9)), params, eos_token_ids=frozenset([257]),
                   block_size=16, max_tokens=4)  # fmt: skip


@pytest.mark.parametrize(("cores", "taken_at"), [(None, 0.001), (8, 0.006)])
def test_a_request_reaching_a_stepping_engine_is_taken_in_its_cpu_later(
    cores: int | None, taken_at: float
) -> None:
    # 5 ms of the HTTP thread's CPU per request. r0 finds the engine idle: taken in at once
    # (its first step waits out the 5 ms). r1 comes at 1 ms, while that step runs: on shared
    # cores the HTTP thread takes turns with the engine thread, so the engine has r1 at 6 ms;
    # on an accelerator at 1 ms. Either way the engine's next step still waits out r1's 5 ms.
    loop = EventLoop()
    share = CoreShare(cores, 1, lambda _t: 1.0) if cores is not None else None
    w = _worker(loop, share, 0.005)
    seen: list[tuple[bool, int]] = []  # (engine stepping, requests it has waiting)
    w.submit(_request("r0"))
    loop.at(0.001, lambda: w.submit(_request("r1")))
    for t in (0.0009, taken_at - 1e-4, taken_at + 1e-4):
        loop.at(t, lambda: seen.append((w.busy, len(w.scheduler.waiting))))
    loop.run()
    assert seen == [(True, 0), (True, 0), (True, 1)]  # r0's step (15 ms) runs throughout
    w.kv.check_integrity()
    assert w.pool.num_free_blocks == 64  # both ended: every block back
