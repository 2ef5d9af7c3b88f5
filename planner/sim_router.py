"""The router on the virtual clock: the real placement over what a real router would know.

For each request, as ``tandem.router.flow`` does: choose a decode (or colocated) worker with
``Placer.choose`` over ``Candidate`` snapshots, decide local or remote prefill with
``decide_prefill``, choose a prefill worker the same way, hand the prefill's KV parameters to the
decode worker. What the router knows is modelled as it is: prefix overlap from a real
``PrefixIndex`` fed by the workers' KV events (after ``event_seconds``), load from heartbeats
(each worker's snapshot refreshed every ``heartbeat_seconds``, so it lags), and its own in-flight
counts (exact). Client-side times add the profile's serving latencies.

A router process is one event loop: its CPU work on each request (``router_request_cpu``), each
P/D hand-off (``router_handoff_cpu``) and each streamed token (``router_token_cpu``) is served
first come, first served, so at high token rates tokens and placements queue behind each other,
as they do in the real router. Each request is served by one of ``RouterConfig.routers`` such
loops (round robin, as a load balancer spreads connections); the rest of each serving latency
is a plain delay.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.hashing import hash_block_tokens
from tandem.engine.kv_connector import KVTransferParams
from tandem.engine.kv_events import KVEvent, KVEventBatch
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim.profile import ServingCost
from tandem.planner.cores import CoreShare
from tandem.planner.events import EventLoop
from tandem.planner.metrics import RequestTrace
from tandem.planner.sim_worker import SimWorker, WorkerCallbacks, WorkerLoad
from tandem.planner.workload import WorkloadRequest
from tandem.prefill.hooks import mark_remote_decode
from tandem.router.placement import Candidate, Placer, PrefillMode, decide_prefill
from tandem.router.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class RouterConfig:
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0
    heartbeat_seconds: float = 1.0
    event_seconds: float = 0.0005
    routers: int = 1


class RouterLoop:
    """One router process's event loop as a single FIFO server on the virtual clock.

    ``wake_share`` of each item's CPU (measured one request at a time, where every item finds
    the loop asleep) is the loop's turn for it: waking, polling its sockets, dispatching. The
    loop takes its items in turns: one that finds it asleep wakes it and begins a turn; one
    that arrives while it is busy waits for the next turn, and the first to do so pays that
    turn (a poll and dispatch, though no wake-up); the items that arrive before that turn
    begins ride it and cost only the rest. With several streams whose tokens arrive together
    one turn takes many ready sockets, so the CPU per token falls (the serving calibration
    measures both ends: ``ServingCost.router_wake_share``). Letting every item that found the
    loop busy ride charged the demo's router 1.40-1.54x too little CPU per request at its
    moderate rates, where tokens come one at a time while the loop is still busy with the
    last; the turns close a fifth to a quarter of that (docs/planning.md, rounds 41-42)."""

    __slots__ = ("loop", "busy_until", "busy_seconds", "share", "wake_share", "_next_turn")

    def __init__(self, loop: EventLoop, share: CoreShare | None = None,
                 wake_share: float = 0.0) -> None:  # fmt: skip
        self.loop = loop
        self.busy_until = 0.0
        self.busy_seconds = 0.0
        self.share = share  # told of each burst of CPU, where the cores are shared
        self.wake_share = wake_share
        self._next_turn = -1.0  # when the loop's latest turn begins (or began)

    def _queue(self, cpu: float) -> None:
        now = self.loop.now
        start = max(now, self.busy_until)
        if self._next_turn >= now:  # a turn that has not begun takes it too: it rides
            cpu *= 1.0 - self.wake_share
        elif self.busy:  # the loop's next turn, after its running one, is for it
            self._next_turn = start
        else:  # it wakes the loop: a core first, if every one is taken
            if self.share is not None:
                start += self.share.wake_wait(start, self)
            self._next_turn = start
        wall = cpu
        if self.share is not None:
            # The loop is a thread on the shared cores: its burst runs at its share of them.
            wall = self.share.burst_seconds(self, start, cpu)
            self.share.burst(start, start + wall, 1, self)
        self.busy_until = start + wall
        self.busy_seconds += cpu

    def serve(self, cpu: float, latency: float, then: Callable[[], None]) -> None:
        """Run ``then`` once ``cpu`` seconds of this loop's time (after the work queued before
        it, at its share of shared cores) and the rest of ``latency`` have passed; in order for
        equal latencies."""
        self._queue(cpu)
        self.loop.at(self.busy_until + max(0.0, latency - cpu), then)

    def spend(self, cpu: float) -> None:
        """Queue ``cpu`` seconds of work that nothing waits on (the client's own CPU)."""
        self._queue(cpu)

    @property
    def busy(self) -> bool:
        return self.busy_until > self.loop.now


class SimRouter:
    """Owns the placement state; ``workers`` register before the first arrival."""

    def __init__(
        self,
        loop: EventLoop,
        placer: Placer,
        config: RouterConfig,
        serving: ServingCost,
        block_size: int,
        eos_token_ids: frozenset[int],
        on_done: Callable[[RequestTrace], None],
        seed: int | None = None,
        share: CoreShare | None = None,
        client_loop: bool = False,
    ) -> None:
        """``seed``: draw each request's serving latency from ``serving.request_spread`` and
        each P/D hand-off's from ``serving.handoff_spread`` (seeded); None: every request gets
        ``serving.request_seconds`` and ``serving.handoff_seconds``. ``share``: the cores
        the loops share with the workers (their bursts are reported to it; the simulator
        registers ``busy_loops`` with it). ``client_loop``: the load generator runs on those
        cores too; ``client`` then queues its CPU per request and per token
        (``serving.client_*_cpu``)."""
        self.loop = loop
        self.placer = placer
        self.config = config
        self.serving = serving
        self.block_size = block_size
        self.eos = eos_token_ids
        self.index = PrefixIndex(lambda: loop.now)
        self.workers: list[SimWorker] = []
        self._snapshot: dict[str, WorkerLoad] = {}
        self._inflight: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self._traces: dict[str, RequestTrace] = {}
        self._owner: dict[str, str] = {}  # sub-request id -> client request id
        self._pending_decode: dict[str, tuple[SimWorker, WorkloadRequest]] = {}
        self._on_done = on_done
        self.gaps: list[float] = []  # every gap the client sees
        self.decode_gaps: list[float] = []  # every gap after the router's first token
        self.placements: dict[str, int] = {}
        self.loops = [RouterLoop(loop, share, serving.router_wake_share)
                      for _ in range(config.routers)]  # fmt: skip
        self.client = (
            RouterLoop(loop, share, serving.client_wake_share)
            if client_loop and share is not None else None
        )  # fmt: skip
        self._loop_of: dict[str, RouterLoop] = {}
        self._arrivals = 0
        self._spread = serving.request_spread if seed is not None else ()
        self._rng = random.Random(seed)
        # Its own stream: a profile without the hand-off's spread draws the requests' as before.
        self._handoff_spread = serving.handoff_spread if seed is not None else ()
        self._handoff_rng = random.Random(None if seed is None else seed + 1)

    @property
    def busy_loops(self) -> list[RouterLoop]:
        """The single-threaded loops that take CPU beside the workers: the router's, and the
        client's where it shares the cores."""
        return [*self.loops] + ([self.client] if self.client is not None else [])

    @property
    def callbacks(self) -> WorkerCallbacks:
        return WorkerCallbacks(self._on_output, self._on_handoff, self._on_events)

    def register(self, worker: SimWorker, phase: float) -> None:
        """Add a worker (synced prefix index, empty load); heartbeats start at ``phase``."""
        self.workers.append(worker)
        eid = worker.engine_id
        self._snapshot[eid] = WorkerLoad()
        self._inflight[eid] = 0
        self._seq[eid] = 0
        self.index.add_worker(eid, worker.pool.num_blocks)
        self.index.load_snapshot(eid, eid, 0, [])
        self.loop.at(phase, lambda: self._heartbeat(worker))

    def _heartbeat(self, worker: SimWorker) -> None:
        self._snapshot[worker.engine_id] = worker.load
        self.loop.after(self.config.heartbeat_seconds, lambda: self._heartbeat(worker))

    # ---- a request's path ---------------------------------------------------------------------
    def arrive(self, rid: str, wr: WorkloadRequest) -> None:
        """At ``wr.arrival``: the client sends; placement after the router's own latency."""
        trace = RequestTrace(wr.arrival, len(wr.prompt_token_ids), wr.max_tokens)
        self._traces[rid] = trace
        router = self.loops[self._arrivals % len(self.loops)]
        self._arrivals += 1
        self._loop_of[rid] = router
        sv = self.serving
        if self.client is not None:
            self.client.spend(sv.client_request_cpu)
        latency = sv.request_seconds
        if self._spread:  # the first token's measured latency, less the token's own part
            latency = max(sv.router_request_cpu, self._rng.choice(self._spread) - sv.token_seconds)
        router.serve(sv.router_request_cpu, latency, lambda: self._place(rid, wr, trace))

    def _candidates(self, workers: list[SimWorker], hashes: list) -> list[Candidate]:
        out = []
        for w in workers:
            snap = self._snapshot[w.engine_id]
            out.append(
                Candidate(w.engine_id, self.index.overlap(w.engine_id, hashes), len(hashes),
                          snap.running, snap.waiting, snap.kv_usage, self._inflight[w.engine_id])
            )  # fmt: skip
        return out

    def _choose(self, pool: str, roles: tuple[Role, ...], hashes: list) -> tuple[SimWorker, int]:
        workers = [w for w in self.workers if w.role in roles]
        choice = self.placer.choose(pool, self._candidates(workers, hashes))
        (worker,) = [w for w in workers if w.engine_id == choice.engine_id]
        if len(hashes) > choice.overlap_blocks:
            self.index.mark_expecting(worker.engine_id)
        return worker, choice.overlap_blocks

    def _request(self, rid: str, wr: WorkloadRequest) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=wr.max_tokens, ignore_eos=True)
        return Request(rid, list(wr.prompt_token_ids), params, eos_token_ids=self.eos,
                       block_size=self.block_size, arrival_time=self.loop.now,
                       max_tokens=wr.max_tokens)  # fmt: skip

    def _place(self, rid: str, wr: WorkloadRequest, trace: RequestTrace) -> None:
        hashes = hash_block_tokens(list(wr.prompt_token_ids), self.block_size)
        d, overlap = self._choose("decode", (Role.DECODE, Role.COLOCATED), hashes)
        prefills = [w for w in self.workers if w.role is Role.PREFILL]
        decision = decide_prefill(
            prompt_tokens=len(wr.prompt_token_ids),
            decode_cached_tokens=overlap * self.block_size,
            threshold_tokens=self.config.local_prefill_threshold,
            decode_is_colocated=d.role is Role.COLOCATED,
            prefill_available=bool(prefills),
            prefill_min_queue=min(
                (self._snapshot[w.engine_id].waiting + self._inflight[w.engine_id]
                 for w in prefills), default=0),
            overload_queue=self.config.prefill_overload_queue,
        )  # fmt: skip
        trace.path = decision.reason
        self.placements[decision.reason] = self.placements.get(decision.reason, 0) + 1
        if decision.mode is PrefillMode.REMOTE:
            p, _ = self._choose("prefill", (Role.PREFILL,), hashes)
            req = self._request(f"{rid}-p", wr)
            mark_remote_decode([req])
            self._send(p, req, rid)
            self._pending_decode[f"{rid}-p"] = (d, wr)
        else:
            self._send(d, self._request(f"{rid}-d", wr), rid)

    def _send(self, worker: SimWorker, req: Request, rid: str) -> None:
        self._inflight[worker.engine_id] += 1
        self._owner[req.request_id] = rid
        worker.submit(req)

    def _on_handoff(self, worker: SimWorker, req: Request, wire: dict) -> None:
        """Prefill finished: its first token streams to the client, its KV goes to decode."""
        self._inflight[worker.engine_id] -= 1
        rid = self._owner.pop(req.request_id)
        self._token(rid, req, final=False, handoff=True)
        d, wr = self._pending_decode.pop(req.request_id)
        params = KVTransferParams.from_dict(wire)

        def admit() -> None:
            dreq = self._request(f"{rid}-d", wr)
            # As decode/intake.attach_remote_kv: the prefill's token is output 0.
            dreq.append_output_token(params.first_token_id)
            dreq.kv_transfer_params = params
            self._send(d, dreq, rid)

        sv = self.serving
        handoff = sv.handoff_seconds
        if self._handoff_spread:  # the hand-off's measured gap, drawn on its own stream
            handoff = self._handoff_rng.choice(self._handoff_spread)
        if sv.router_handoff_cpu <= 0.0:  # not measured: a plain delay, as before the figure
            self.loop.after(handoff, admit)
            return
        # The router's part of the hand-off runs on the request's loop (queued behind its
        # other work there); a lone one still takes the hand-off's latency, which holds it.
        self._loop_of[rid].serve(sv.router_handoff_cpu, handoff, admit)

    def _on_output(self, worker: SimWorker, req: Request, new_token: bool, finished: bool) -> None:
        rid = self._owner.get(req.request_id)
        if rid is None:
            return
        if finished:
            self._inflight[worker.engine_id] -= 1
            del self._owner[req.request_id]
            self._pending_decode.pop(req.request_id, None)
        if new_token:
            self._token(rid, req, final=finished)
        elif finished:
            self._finish(rid)

    def _token(self, rid: str, req: Request, final: bool, handoff: bool = False) -> None:
        trace = self._traces[rid]
        if trace.num_tokens == 0:
            trace.num_cached_tokens = max(req.num_cached_tokens, 0)

        def deliver() -> None:
            now = self.loop.now
            if trace.first_token is None:
                trace.first_token = now
            else:
                self.gaps.append(now - (trace.last_token or now))
            if not handoff:
                if trace.router_first is None:
                    trace.router_first = now
                elif trace.last_token is not None:
                    self.decode_gaps.append(now - trace.last_token)
            trace.last_token = now
            trace.num_tokens += 1
            if self.client is not None:
                self.client.spend(self.serving.client_token_cpu)
            if final:
                self._finish(rid)

        sv = self.serving
        self._loop_of[rid].serve(sv.router_token_cpu, sv.token_seconds, deliver)

    def _finish(self, rid: str) -> None:
        self._loop_of.pop(rid, None)
        trace = self._traces.pop(rid)
        trace.finished = True
        self._on_done(trace)

    def _on_events(self, worker: SimWorker, events: list[KVEvent]) -> None:
        eid = worker.engine_id
        batch = KVEventBatch(eid, self._seq[eid], tuple(events))
        self._seq[eid] += 1
        self.loop.after(self.config.event_seconds, lambda: self.index.apply(eid, batch))

    @property
    def in_flight(self) -> int:
        return len(self._traces)

    @property
    def unfinished(self) -> list[RequestTrace]:
        return list(self._traces.values())
