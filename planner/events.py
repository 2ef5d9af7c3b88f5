"""The virtual clock: a heap of timed callbacks, run in time order (ties in scheduling order).

Owned by ``simulator.simulate``; every simulated component schedules on it and reads ``now``.
Nothing here reads a real clock, so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (never earlier than now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Run events in order until none is left or ``until()`` says stop (checked after each)."""
        heap = self._heap
        while heap:
            t, _, fn = heapq.heappop(heap)
            self.now = t
            self.num_events += 1
            fn()
            if until():
                return
