"""Shared CPU cores on the virtual clock: engine steps and the single-threaded work beside them.

Workers of `tandem up` on one CPU host share its cores with the router's event loops, their
own streaming threads and, in a benchmark on the same machine, the load generator. The model is
processor sharing: while n threads want the cores, each runs at min(1, cores / n). Everything's
busy period is known on the virtual clock (a step's end, a loop's queue), so:

- a step that starts charges itself for the work already running beside it
  (:func:`shared_seconds` over the others' remaining busy periods);
- work that starts beside running steps (a router loop's burst, a streaming thread's tokens,
  another worker's step) lengthens those steps by the share it takes while it lasts, each
  neighbour counted only until it ends (:meth:`CoreShare.burst`, :func:`lengthened`);
- except where worker steps already hold every core (P/D on a CPU host: a prefill step beside
  a decode step): there a router or client loop's burst is not spread over the steps but
  taken whole from one of them, the prefill's. Measured (``benchmarks/plan_contention.py``,
  docs/planning.md round 48): a 128-token prefill beside another request's decode took 20-30
  ms longer than alone; with the two workers pinned to a core each and the router and client
  free, still 19 ms longer; with the router and client pinned beside the decode worker, 5 ms.
  The kernel puts the woken loop on the prefill's core, and the prefill waits out its CPU;
- a single-threaded burst (a router or client loop's, a worker's streaming thread's) runs at
  its share too, from what is running when it starts (:meth:`CoreShare.burst_seconds`): the
  loops are threads on the same cores, and a token they handle waits for that.

A short burst beside a long step so costs the step only the burst's share; a ratio taken at the
step's start would stretch the whole step. (It once did, in ``burst``: a decode step that began
while its own streaming thread had 0.1 ms of a row left counted that thread for its whole 5 ms,
and so slowed a prefill beside it to 2/3 for all of it. That over-count stood in for the loops'
cost above, but only in profiles whose ``row_seconds`` came out above 0: round 48.) Owned by
``simulator.run_simulation``; a worker asks :meth:`CoreShare.step` how long each step lasts,
and the router's loops report their bursts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tandem.engine.role import Role

if TYPE_CHECKING:
    from tandem.planner.sim_worker import SimWorker


class BusyLoop(Protocol):
    """A single-threaded server on the virtual clock (a router loop, the client)."""

    busy_until: float


Piece = tuple[float, float, float]  # (from, to, rate): seconds from now, and the speed between


def _pieces(threads: int, cores: int, others: list[tuple[float, int]], extra: int = 0,
            until: float = 0.0) -> list[Piece]:  # fmt: skip
    """The speed of work on ``threads`` threads from now on, piece by piece, beside ``others``
    (each: seconds until it ends, threads) and ``extra`` more threads for the next ``until``
    seconds, under processor sharing of ``cores``: while n threads want the cores each runs at
    min(1, cores / n). The last piece is unbounded."""
    ends = sorted([*others, (until, extra)] if extra and until > 0.0 else others)
    wanting = threads + sum(k for _, k in ends)
    pieces, t = [], 0.0
    for end, k in ends:
        if end > t:
            pieces.append((t, end, min(1.0, cores / wanting)))
            t = end
        wanting -= k
    pieces.append((t, float("inf"), min(1.0, cores / wanting)))
    return pieces


def _seconds_for(work: float, pieces: list[Piece]) -> float:
    """When ``work`` (seconds alone) is done, at ``pieces``' speeds."""
    for start, end, rate in pieces:
        if work <= (end - start) * rate:
            return start + work / rate
        work -= (end - start) * rate
    raise AssertionError("the last piece is unbounded")


def shared_seconds(
    seconds: float, threads: int, cores: int, others: list[tuple[float, int]]
) -> float:
    """Wall seconds of ``seconds`` of work on ``threads`` threads (its time alone) beside
    ``others``, each (seconds until it ends, threads), under processor sharing of ``cores``:
    while n threads want the cores each runs at min(1, cores / n)."""
    return _seconds_for(seconds, _pieces(threads, cores, others))


def lengthened(
    left: float, threads: int, cores: int, others: list[tuple[float, int]], burst: float,
    burst_threads: int,
) -> float:  # fmt: skip
    """The wall seconds left of a step on ``threads`` threads, ``left`` of them as it runs now
    beside ``others`` (each: seconds until it ends, threads), once ``burst_threads`` more want
    the cores over the next ``burst`` seconds, under processor sharing of ``cores``. The step's
    work left is what it would do at its share while each neighbour still runs; the burst
    takes its part of that share only while it lasts, and only as far as the cores are full."""
    work = 0.0
    for start, end, rate in _pieces(threads, cores, others):
        work += (min(end, left) - start) * rate
        if end >= left:
            break
    return _seconds_for(work, _pieces(threads, cores, others, burst_threads, burst))


class CoreShare:
    """The cores' sharing for one run; ``cores`` None: every worker has its own (an
    accelerator, or simulated workers, whose steps are waits), and only ``pace`` applies."""

    def __init__(self, cores: int | None, threads: int, pace: Callable[[float], float],
                 run_queue_wait: float = 0.0) -> None:  # fmt: skip
        self.cores = cores
        self.threads = threads  # each worker's engine threads
        self.pace = pace  # the machine's pace factor at a virtual time
        self.run_queue_wait = run_queue_wait  # ServingCost.run_queue_wait
        self.workers: list[SimWorker] = []
        self.loops: list[BusyLoop] = []

    def wake_wait(self, now: float, source: object) -> float:
        """How long ``source``'s thread, waking at ``now``, waits for a core: the run-queue wait
        when the threads already busy fill every core (a woken thread runs once a running
        one's time slice ends), else 0. Called by a single-threaded loop that finds itself
        idle (a router or client loop, a worker's streaming thread)."""
        if self.cores is None or self.run_queue_wait <= 0.0:
            return 0.0
        busy = sum(k for _, k in self._busy(now, source))
        return self.run_queue_wait if busy >= self.cores else 0.0

    def _busy(self, now: float, *skip: object) -> list[tuple[float, int]]:
        """(seconds left, threads) of everything busy at ``now`` but the loops and the worker
        steps in ``skip`` (a worker's streaming thread always counts: it is not its step). A
        prefill worker serving a pull holds a core as any thread does; its own step, streaming
        and wake-ups skip it (they wait for it under one GIL instead: ``SimWorker.owed``)."""
        out = [(x.busy_until - now, 1) for x in self.loops if x not in skip and x.busy_until > now]
        for w in self.workers:
            own = w in skip
            if not own and w.busy and w.busy_until > now:
                out.append((w.busy_until - now, self.threads))
            if w.shell_busy_until > now:
                out.append((w.shell_busy_until - now, 1))
            if not own and w.serving_until > now:
                out.append((w.serving_until - now, 1))
        return out

    def burst_seconds(self, source: object, start: float, cpu: float) -> float:
        """The wall seconds of ``source``'s single-threaded burst of ``cpu`` seconds that starts
        at ``start``, beside what is running then (processor sharing, as a step's). Not
        lengthened by work that starts later: the bursts are short (a token's or a request's
        handling), and the one that starts later is charged its own share."""
        if self.cores is None:
            return cpu
        return shared_seconds(cpu, 1, self.cores, self._busy(start, source))

    def step(self, w: SimWorker, seconds: float) -> float:
        """The wall seconds of ``w``'s step of ``seconds`` alone, starting now; the steps
        already running beside it are lengthened by its share (``burst``)."""
        now = w.loop.now
        wall = seconds
        if self.cores is not None:
            wall = shared_seconds(seconds, self.threads, self.cores, self._busy(now, w))
        wall *= self.pace(now)
        self.burst(now, now + wall, self.threads, w)
        return wall

    def burst(self, start: float, end: float, threads: int, source: object) -> None:
        """``source`` will be busy on ``threads`` threads over [start, end) (called before its
        own busy time moves): each worker step running then slows, while the burst lasts, from
        its share beside what else runs to its share with ``threads`` more, and ends that much
        later (``SimWorker.extend``). What else runs is followed as it ends
        (:func:`lengthened`): a streaming thread with a row left to send at a decode step's
        start is busy for its 0.1 ms, not for the whole step beside it. A router or client
        loop's burst while steps hold every core is taken whole from one step, a prefill
        worker's where one runs (the module's docstring)."""
        if self.cores is None or end <= start:
            return
        steps = [w for w in self.workers if w is not source and w.busy and w.busy_until > start]
        if source in self.loops and len(steps) * self.threads >= self.cores:
            # Every core holds a step: the woken loop's CPU comes whole out of one of them.
            prefill = [w for w in steps if w.role is Role.PREFILL]
            (prefill or [max(steps, key=lambda w: w.busy_until)])[0].extend(end - start)
            return
        if sum(k for _, k in self._busy(start, source)) + threads <= self.cores:
            return  # a core for every thread, now and (as they end) after: no step slows
        # Every step's neighbours first: one step's extension does not change another's here.
        running = [(w, w.busy_until - start, self._busy(start, source, w)) for w in steps]
        for w, left, others in running:
            new = lengthened(left, self.threads, self.cores, others, end - start, threads)
            if new > left:
                w.extend(new - left)
