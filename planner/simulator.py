"""``simulate(profile, workload, deployment)``: one deployment under one workload, on a virtual
clock, predicting what the client would measure.

The deployment is P prefill + D decode workers (or D colocated when P is 0) with the engine's
token budget and sequence cap, the router's local-prefill threshold and policy, and the KV
transport whose profiled transfer time applies. Every request is generated up front from the
seed (``workload.generate``) and the run ends when all finished, or early, as overloaded, when
the requests in flight pass ``SimOptions.max_in_flight`` (the queues are growing without bound;
the unfinished requests then count as infinite TTFT). Deterministic for a seed.

``SimOptions.shared_cores``: the workers share one machine's CPU cores (``tandem up`` on a CPU
host, each worker's step using the profile's ``torch_threads``) with the router's loops, their
streaming threads and, with ``client_shares_cores``, the load generator: processor sharing on
the virtual clock (``planner/cores.py``). Off (None) for a deployment where each worker has its
own accelerator, and for simulated workers (their steps wait; they do not compute).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tandem.engine.config import SchedulerConfig
from tandem.engine.role import Role
from tandem.engine.sim.profile import Profile
from tandem.planner.cores import CoreShare
from tandem.planner.events import EventLoop
from tandem.planner.metrics import (
    Percentiles,
    PoolStats,
    RequestTrace,
    SimResult,
    summarize_latencies,
)
from tandem.planner.sim_kv import KVFabric
from tandem.planner.sim_router import RouterConfig, SimRouter
from tandem.planner.sim_worker import SimWorker
from tandem.planner.workload import Workload, generate
from tandem.router.placement import Placer, Policy


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: int = 0
    decode: int = 1  # decode workers, or colocated workers when prefill is 0
    max_num_batched_tokens: int | None = None  # None: as profiled
    max_num_seqs: int | None = None
    num_blocks: int | None = None
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0
    policy: str = "prefix-aware"
    kv_transport: str = "tcp"
    routers: int = 1  # router processes, each one event loop (sim_router.RouterLoop)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("a deployment needs prefill >= 0 and decode >= 1 workers")
        if self.routers < 1:
            raise ValueError("a deployment needs at least one router")
        Policy.parse(self.policy)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def label(self) -> str:
        return f"{self.decode} colocated" if self.colocated else f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class SimOptions:
    seed: int = 0
    max_in_flight: int | None = None  # None: 2 x the deployment's total max_num_seqs, >= 256
    shared_cores: int | None = None
    # The load generator runs on those cores too (a benchmark on one machine, not production
    # traffic): its CPU per request and token (``ServingCost.client_*_cpu``) competes with them.
    client_shares_cores: bool = False
    # Draw the profile's measured variability (ServingCost.request_spread, pace_spread): off
    # for simulated workers, whose steps are waits the machine's pace does not change.
    variability: bool = True
    record_history: bool = False  # keep each worker's per-step schedule (tests)


@dataclass(slots=True)
class Simulation:
    """A finished run: the result plus the objects, for tests that inspect them."""

    result: SimResult
    workers: list[SimWorker]
    router: SimRouter


class MachinePace:
    """The machine's pace over time: constant over windows of ``seconds``, each window's
    factor drawn (seeded) from ``spread``; 1.0 throughout when there is no spread. Every
    worker's step is stretched by the factor of the window it starts in."""

    def __init__(self, spread: tuple[float, ...], seconds: float, seed: int) -> None:
        self._spread = spread if seconds > 0 else ()
        self._seconds = seconds
        self._rng = random.Random(seed)
        self._factors: list[float] = []

    def at(self, t: float) -> float:
        if not self._spread:
            return 1.0
        window = int(t / self._seconds)
        while len(self._factors) <= window:
            self._factors.append(self._rng.choice(self._spread))
        return self._factors[window]


def run_simulation(
    profile: Profile, workload: Workload, dep: Deployment, options: SimOptions = SimOptions()
) -> Simulation:
    wall0 = time.perf_counter()
    loop = EventLoop()
    e = profile.engine
    max_len = profile.model.max_model_len
    cfg = SchedulerConfig(
        max_num_batched_tokens=dep.max_num_batched_tokens or e.max_num_batched_tokens,
        max_num_seqs=dep.max_num_seqs or e.max_num_seqs,
        max_model_len=max_len,
    )
    profile.transfer.seconds(dep.kv_transport, 0)  # ValueError now for an unprofiled transport
    fabric = KVFabric(loop, lambda n: profile.transfer.seconds(dep.kv_transport, n), e.block_bytes)
    done: list[RequestTrace] = []
    threads = profile.threads
    sv = profile.serving
    pace = MachinePace(sv.pace_spread if options.variability else (), sv.pace_seconds,
                       options.seed)  # fmt: skip
    share = CoreShare(options.shared_cores, threads, pace.at, sv.run_queue_wait)
    router = SimRouter(
        loop, Placer(Policy.parse(dep.policy)),
        RouterConfig(dep.local_prefill_threshold, dep.prefill_overload_queue,
                     routers=dep.routers),
        profile.serving, e.block_size, frozenset(profile.model.eos_token_ids), done.append,
        seed=options.seed if options.variability else None,
        share=share, client_loop=options.client_shares_cores,
    )  # fmt: skip
    roles = [Role.PREFILL] * dep.prefill
    roles += [Role.COLOCATED if dep.colocated else Role.DECODE] * dep.decode
    share.loops = router.busy_loops
    workers: list[SimWorker] = []
    share.workers = workers
    num_blocks = dep.num_blocks or e.num_blocks
    counts: dict[Role, int] = {}
    for i, role in enumerate(roles):
        n = counts.get(role, 0)
        counts[role] = n + 1
        w = SimWorker(
            loop, f"{role.label}-{n}", role, profile.step, cfg, num_blocks, e.block_size,
            profile.model.sim_token_ids, fabric, router.callbacks, share,
            sv.step_seconds, sv.row_seconds, sv.request_cpu(role), sv.transfer_cpu(role),
            sv.row_wake_share,
        )  # fmt: skip
        if options.record_history:
            w.history = []
        workers.append(w)
        router.register(w, phase=(i + 1) * router.config.heartbeat_seconds / (len(roles) + 1))
    reqs = generate(workload, profile.model.sim_token_ids, options.seed, max_len)
    for i, wr in enumerate(reqs):
        loop.at(wr.arrival, lambda i=i, wr=wr: router.arrive(f"r{i}", wr))
    bound = options.max_in_flight or max(256, 2 * cfg.max_num_seqs * len(roles))
    loop.run(until=lambda: len(done) == len(reqs) or router.in_flight > bound)
    overloaded = len(done) < len(reqs)
    traces = list(done) + router.unfinished if overloaded else list(done)
    lat = summarize_latencies(traces, router.gaps, router.decode_gaps)
    duration = max((t.last_token or 0.0) for t in done) if done else loop.now
    pools: dict[str, list[SimWorker]] = {}
    for w in workers:
        pools.setdefault(w.role.label, []).append(w)
    result = SimResult(
        total=len(reqs),
        completed=len(done),
        overloaded=overloaded,
        duration=duration,
        ttft=lat.ttft,
        itl=lat.itl,
        e2e=lat.e2e,
        token_gap=lat.token_gap,
        router_ttft=lat.router_ttft,
        router_itl=lat.router_itl,
        output_tokens_per_s=sum(t.num_tokens for t in done) / duration if duration else 0.0,
        pools={name: _pool_stats(ws, duration) for name, ws in pools.items()},
        paths=dict(router.placements),
        events=loop.num_events,
        wall_seconds=time.perf_counter() - wall0,
        traces=tuple(traces),
    )
    return Simulation(result, workers, router)


def _pool_stats(workers: list[SimWorker], duration: float) -> PoolStats:
    n = len(workers)
    span = max(duration, 1e-9)
    return PoolStats(
        workers=n,
        utilization=sum(w.busy_seconds for w in workers) / (n * span),
        mean_kv_usage=sum(w.mean_kv_usage(span) for w in workers) / n,
        max_kv_usage=max(w.max_kv_usage for w in workers),
        max_waiting=max(w.max_waiting for w in workers),
        steps=sum(w.steps for w in workers),
        preemptions=sum(w.scheduler.num_preemptions for w in workers),
        engine_seconds=sum(w.engine_seconds for w in workers),
        first_token=Percentiles.of([s for w in workers for s in w.first_token_seconds]),
    )


def simulate(
    profile: Profile, workload: Workload, dep: Deployment, options: SimOptions = SimOptions()
) -> SimResult:
    """The predicted client-side latencies and pool load of ``dep`` under ``workload``."""
    return run_simulation(profile, workload, dep, options).result
