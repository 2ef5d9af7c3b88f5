"""Shared CPU cores on the virtual clock: engine steps and the single-threaded work beside them.

Workers of `tandem up` on one CPU host share its cores with the router's event loops, their
own streaming threads and, in a benchmark on the same machine, the load generator. The model is
processor sharing: while n threads want the cores, each runs at min(1, cores / n). Everything's
busy period is known on the virtual clock (a step's end, a loop's queue), so:

- a step that starts charges itself for the work already running beside it
  (:func:`shared_seconds` over the others' remaining busy periods);
- work that starts beside running steps (a router loop's burst, a streaming thread's tokens,
  another worker's step) lengthens those steps by the share it takes (:meth:`CoreShare.burst`);
- a single-threaded burst (a router or client loop's, a worker's streaming thread's) runs at
  its share too, from what is running when it starts (:meth:`CoreShare.burst_seconds`): the
  loops are threads on the same cores, and a token they handle waits for that.

A short burst beside a long step so costs the step only the burst's share; a ratio taken at the
step's start would stretch the whole step. Owned by ``simulator.run_simulation``; a worker asks
:meth:`CoreShare.step` how long each step lasts, and the router's loops report their bursts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tandem.planner.sim_worker import SimWorker


class BusyLoop(Protocol):
    """A single-threaded server on the virtual clock (a router loop, the client)."""

    busy_until: float


def shared_seconds(
    seconds: float, threads: int, cores: int, others: list[tuple[float, int]]
) -> float:
    """Wall seconds of ``seconds`` of work on ``threads`` threads (its time alone) beside
    ``others``, each (seconds until it ends, threads), under processor sharing of ``cores``:
    while n threads want the cores each runs at min(1, cores / n)."""
    others = sorted(others)
    wanting = threads + sum(k for _, k in others)
    left, t = seconds, 0.0
    for end, k in others:
        rate = min(1.0, cores / wanting)
        if left <= (end - t) * rate:
            break
        left -= (end - t) * rate
        t = end
        wanting -= k
    return t + left / min(1.0, cores / wanting)


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
        own busy time moves): each worker step running then slows from min(1, cores / n) to
        min(1, cores / (n + threads)) over the overlap and ends that much later
        (``SimWorker.extend``)."""
        if self.cores is None or end <= start:
            return
        # Everything wanting the cores at `start` but the source; each running step is among
        # them, so one count serves every step.
        n = sum(k for _, k in self._busy(start, source))
        if n == 0:  # nothing else runs: no step to lengthen
            return
        before, after = min(1.0, self.cores / n), min(1.0, self.cores / (n + threads))
        if after >= before:
            return
        for w in self.workers:
            if w is source or not w.busy or w.busy_until <= start:
                continue
            # The step's work left at `start`, done at `after` during the burst, then `before`.
            work = (w.busy_until - start) * before
            during = (end - start) * after
            if work <= during:
                new_end = start + work / after
            else:
                new_end = end + (work - during) / before
            w.extend(new_end - w.busy_until)
