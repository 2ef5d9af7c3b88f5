"""One simulated worker: the engine's step loop on the virtual clock, over the real core.

A ``SimWorker`` owns a real ``BlockPool``, ``KVCacheManager`` and ``Scheduler`` and runs the real
role hooks (``ColocatedHooks``, ``PrefillHooks``, ``DecodeHooks`` over a ``SimConnector``), in
``Engine.step``'s order: ``before_step`` -> ``schedule`` -> ``on_scheduled`` -> (the step's
profiled time passes) -> ``update`` -> outputs and hand-offs -> KV events. Steps run back to back
while there is work, as on the engine thread; an idle worker sleeps until a request, a finished
load or a release wakes it at once (as the real connector wakes its engine thread,
``EngineThread.wake``). Tokens come from ``tandem.engine.sim.tokens.sample``, as on a simulated
worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from tandem.decode.hooks import DecodeHooks, LoadFailurePolicy
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.hooks import ColocatedHooks, RoleHooks
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_events import KVEvent
from tandem.engine.outputs import EngineOutput, SchedulerOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.role import Role
from tandem.engine.scheduler import Scheduler
from tandem.engine.sim.cost_model import StepCost
from tandem.engine.sim.tokens import sample
from tandem.planner.cores import CoreShare
from tandem.planner.events import EventLoop
from tandem.planner.sim_kv import KVFabric
from tandem.prefill.hooks import PrefillHooks


@dataclass(slots=True)
class WorkerLoad:
    """What a heartbeat carries (EngineStats' load fields)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class WorkerCallbacks:
    """How a worker reports to the simulated router (all called on the virtual clock)."""

    # A request's new token (True) or its end without one (False: ended in a role hook), and
    # whether the request had ended when its step did (a token is delivered after the streaming
    # thread's turn, when later steps may have ended the request).
    on_output: Callable[[SimWorker, Request, bool, bool], None]
    on_handoff: Callable[[SimWorker, Request, dict], None]  # prefill done: kv_transfer_params
    on_events: Callable[[SimWorker, list[KVEvent]], None]  # after every step with events


class SimWorker:
    def __init__(
        self,
        loop: EventLoop,
        engine_id: str,
        role: Role,
        cost: StepCost,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        token_ids: tuple[int, ...],
        fabric: KVFabric,
        callbacks: WorkerCallbacks,
        cores: CoreShare | None = None,
        step_overhead: float = 0.0,
        row_overhead: float = 0.0,
        request_overhead: float = 0.0,
        transfer_overhead: float = 0.0,
        row_wake_share: float = 0.0,
    ) -> None:
        self.loop = loop
        self.engine_id = engine_id
        self.role = role
        self.cost = cost
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.kv = KVCacheManager(self.pool, block_size, True)
        self.scheduler = Scheduler(config, self.kv)
        self._tokens = token_ids
        self._cb = callbacks
        # A step's wall seconds from its seconds alone (shared cores, the machine's pace).
        self._cores = cores or CoreShare(None, 1, lambda _t: 1.0)
        self._extension = 0.0  # what work started beside the running step adds to it
        # The serving worker's own time per step and per streamed sequence (ServingCost).
        self._overhead = step_overhead
        self._row_overhead = row_overhead
        self._row_wake_share = row_wake_share  # of row_overhead: waking the HTTP thread
        # Streaming a step's tokens runs on the worker's HTTP thread after the step, in parallel
        # with the next one where a core is free: CPU the shared-core slowdown counts while
        # ``shell_busy_until`` is ahead, not time added to the step. The thread is a FIFO
        # server: each token leaves the worker after the rows streamed before it.
        self.shell_busy_until = 0.0
        # The HTTP side's work on each request sent here, taken from the next step (one GIL).
        self._request_overhead = request_overhead
        self._owed = 0.0
        # Serving a pull runs beside the engine thread from the pull's end (one GIL): until
        # ``serving_until`` a step that starts waits for the GIL; one that starts later has
        # lost nothing (the work was done while the worker idled). Until then it is also a
        # thread on the shared cores, which ``CoreShare`` counts for every other thread.
        self.serving_until = 0.0
        self.hooks: RoleHooks
        if role is Role.COLOCATED:
            self.hooks = ColocatedHooks()
        else:
            conn = fabric.connector(engine_id, self.wake)
            if transfer_overhead:
                # Serving a pull (its side channel and data socket, beside the engine thread
                # under one GIL) comes after the first token, so it delays later steps only,
                # and only the steps that start while it is still going on.
                conn.on_served = lambda: self._serve_pull(transfer_overhead)
            if role is Role.PREFILL:
                self.hooks = PrefillHooks(conn)
            else:
                self.hooks = DecodeHooks(conn, LoadFailurePolicy.RECOMPUTE)
        self.busy = False
        self.busy_until = 0.0  # when the running step ends (valid while busy)
        self._wake_at: float | None = None
        # Observability of the run.
        self.steps = 0
        self.busy_seconds = 0.0
        # Of busy_seconds, the engine's steps' share (the rest: serving work charged to
        # them), as the worker's tandem_worker_busy_seconds_total counts a real one's.
        self.engine_seconds = 0.0
        self._engine_share = 1.0
        self.max_waiting = 0
        self.max_kv_usage = 0.0
        self._usage_area = 0.0
        self._usage_since = 0.0
        self.history: list[list[tuple[str, int]]] | None = None  # per step, when recording
        # Arrival here to the first token sampled here, per request: the real worker's
        # tandem_worker_time_to_first_token_seconds (engine/worker/metrics.py).
        self.first_token_seconds: list[float] = []
        self._arrived: dict[str, float] = {}
        self._in_run_queue = False  # the idle engine thread woke onto full cores: ``_wake``

    @property
    def shell_busy(self) -> bool:
        return self.shell_busy_until > self.loop.now

    @property
    def load(self) -> WorkerLoad:
        s = self.scheduler
        return WorkerLoad(len(s.running) + len(s.loading), len(s.waiting), self.pool.usage)

    def submit(self, req: Request) -> None:
        """A request reaches the worker's HTTP thread (called by ``SimRouter``). An idle thread
        wakes for it, a core first if every one is taken (``CoreShare.wake_wait``, as for every
        thread that wakes), then hands it to the engine thread (``_admit``)."""
        wait = 0.0 if self.shell_busy else self._cores.wake_wait(self.loop.now, self)
        if wait > 0.0:
            self.loop.after(wait, partial(self._admit, req))
        else:
            self._admit(req)

    def _admit(self, req: Request) -> None:
        """The request reaches the engine thread: role check, queue, wake."""
        self.hooks.on_admit(req)
        self.scheduler.add_request(req)
        self._arrived[req.request_id] = self.loop.now
        self._owed += self._request_overhead
        self.max_waiting = max(self.max_waiting, len(self.scheduler.waiting))
        self.wake()

    @property
    def owed(self) -> float:
        """What a step starting now would wait for: the CPU the HTTP side has spent on this
        worker's requests since its last step, and what is left of serving a pull."""
        return self._owed + max(0.0, self.serving_until - self.loop.now)

    def _serve_pull(self, seconds: float) -> None:
        start = max(self.loop.now, self.serving_until)
        self.serving_until = start + seconds
        self._cores.burst(start, self.serving_until, 1, self)

    def wake(self, delay: float = 0.0) -> None:
        if self.busy or self._in_run_queue:
            return
        t = self.loop.now + delay
        if self._wake_at is not None and self._wake_at <= t:
            return
        self._wake_at = t
        self.loop.at(t, self._wake)

    def _wake(self) -> None:
        if self._wake_at is None or self.loop.now < self._wake_at:
            return  # superseded by an earlier wake
        if not self._in_run_queue:
            # The idle engine thread wakes: a core first, if every one is taken.
            wait = self._cores.wake_wait(self.loop.now, self)
            if wait > 0.0:
                self._in_run_queue = True
                self._wake_at = self.loop.now + wait
                self.loop.at(self._wake_at, self._wake)
                return
        self._in_run_queue = False
        self._wake_at = None
        self._step()

    def _step(self) -> None:
        if self.busy:
            return
        sched = self.scheduler
        ended = self.hooks.before_step(sched)
        out = sched.schedule()
        ended += self.hooks.on_scheduled(sched, out)
        for req in ended:
            self._cb.on_output(self, req, False, req.is_finished)
        if out.is_empty:
            self._events()
            return  # idle: a request, a finished load or a release wakes it
        rows = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled]
        if self.history is not None:
            self.history.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        serving = self.owed + self._overhead
        self._owed = 0.0
        self.serving_until = min(self.serving_until, self.loop.now)
        engine = self.cost.step_seconds(rows)
        self._engine_share = engine / (engine + serving) if engine + serving > 0 else 1.0
        seconds = self._cores.step(self, engine + serving)
        self.busy = True
        self.busy_until = self.loop.now + seconds
        self.steps += 1
        self.busy_seconds += seconds
        self.engine_seconds += seconds * self._engine_share
        self.loop.after(seconds, lambda: self._finish(out))

    def extend(self, seconds: float) -> None:
        """The running step ends ``seconds`` later (work began beside it on shared cores)."""
        self.busy_until += seconds
        self.busy_seconds += seconds
        self.engine_seconds += seconds * self._engine_share
        self._extension += seconds

    def _finish(self, out: SchedulerOutput) -> None:
        if self._extension > 0.0:
            late, self._extension = self._extension, 0.0
            self.loop.after(late, lambda: self._finish(out))
            return
        changed = self.scheduler.update(out, sample(out, self._tokens))
        arrived, now = self._arrived, self.loop.now
        for req in changed:
            t0 = arrived.pop(req.request_id, None)  # present until its first token
            if t0 is not None:
                self.first_token_seconds.append(now - t0)
        self._track_usage()
        start = max(self.loop.now, self.shell_busy_until)
        if not self.shell_busy:  # the HTTP thread wakes: a core first, if every one is taken
            start += self._cores.wake_wait(start, self)
        # The step's rows reach the HTTP thread in one hand-over: a thread already busy (with
        # the last step's rows) takes them without waking (``RouterLoop``'s ``wake_share``).
        riders = len(changed) if self.shell_busy else max(0, len(changed) - 1)  # pay no wake-up
        cpu = self._row_overhead * (len(changed) - self._row_wake_share * riders)
        wall = self._cores.burst_seconds(self, start, cpu)
        self._cores.burst(start, start + wall, 1, self)
        self.shell_busy_until = start + wall
        per_row = wall / len(changed) if changed else 0.0
        for i, req in enumerate(changed):
            sent = start + (i + 1) * per_row  # this row's token leaves the worker
            if req.status == RequestStatus.FINISHED_REMOTE_DECODE:
                final = EngineOutput(req.request_id, req.group_id, 0, [], True)
                self.hooks.on_handoff(req, final)
                assert final.kv_transfer_params is not None
                self.loop.at(sent, partial(self._cb.on_handoff, self, req,
                                           final.kv_transfer_params))  # fmt: skip
            else:
                self.loop.at(sent, partial(self._cb.on_output, self, req, True, req.is_finished))
        self._events()
        self.busy = False
        self._step()

    def _events(self) -> None:
        events = self.pool.take_events()
        if events:
            self._cb.on_events(self, events)

    def _track_usage(self) -> None:
        now = self.loop.now
        usage = self.pool.usage
        self._usage_area += usage * (now - self._usage_since)
        self._usage_since = now
        self.max_kv_usage = max(self.max_kv_usage, usage)

    def mean_kv_usage(self, duration: float) -> float:
        return self._usage_area / duration if duration > 0 else 0.0

    @property
    def unfinished(self) -> int:
        s = self.scheduler
        return s.num_unfinished + len(s.pinned)
