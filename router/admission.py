"""Admission control at the router: how much it sends the workers at once, how much waits here,
and who is refused (DESIGN.md §7 "Admission"). Pure and synchronous; ``gate.py`` awaits it.

Units are worker sub-requests ("slots"): a request with n choices needs n. A request is admitted
at once while the in-flight slots stay within the limit and nobody waits ahead of it (a request
bigger than the whole limit still runs when nothing else does, so it cannot wait forever).
Otherwise it queues, ordered by priority (lower is served first, as in vLLM) then arrival, for
at most the queue timeout. A full queue sheds the lowest priority first: a newcomer with a
strictly better priority than the worst queued request takes its place, and that one is
refused; otherwise the newcomer is refused. Every refusal names its reason (the ``reason`` label
of ``tandem_router_rejections_total``) and comes with a ``Retry-After`` estimate.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from enum import StrEnum

# Capacity-derived limit: worker sub-requests per sequence slot of the decode pool (the running
# batch plus as many queued on the workers, so they never idle between two dispatches).
SLOTS_PER_WORKER_SEQ = 2
MAX_RETRY_AFTER_S = 60


class Rejection(StrEnum):
    QUEUE_FULL = "queue_full"  # the queue was full of requests at least as important
    SHED = "shed"  # queued, then pushed out by a more important request
    QUEUE_TIMEOUT = "queue_timeout"  # waited longer than the queue timeout


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place; owned by the caller between ``offer`` and ``release``/``cancel``."""

    priority: int
    slots: int
    arrival: float
    deadline: float  # queue deadline
    seq: int
    admitted: bool = False
    rejected: Rejection | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.seq)


@dataclass(slots=True)
class Decision:
    """What one call changed: tickets admitted now and tickets refused now (either may be the
    caller's own)."""

    admitted: list[Ticket] = field(default_factory=list)
    rejected: list[Ticket] = field(default_factory=list)


class Admission:
    """In-flight slots and the priority queue. Not thread-safe: the router's event loop owns it.

    ``limit`` is passed on each call (it follows the registered workers' capacity)."""

    def __init__(self, max_queued: int, queue_timeout_s: float) -> None:
        if max_queued < 0 or queue_timeout_s < 0:
            raise ValueError("max_queued and queue_timeout_s must be >= 0")
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self._queue: list[Ticket] = []  # sorted by key: head first, the one to shed last
        self._seq = itertools.count()
        self._service_s = 1.0  # moving average of admitted requests' duration (Retry-After)

    @property
    def depth(self) -> int:
        return len(self._queue)

    def offer(self, priority: int, slots: int, now: float, limit: int) -> tuple[Ticket, Decision]:
        t = Ticket(priority, max(1, slots), now, now + self.queue_timeout_s, next(self._seq))
        d = Decision()
        if not self._queue and self._fits(t, limit):
            self._admit(t, d)
            return t, d
        if len(self._queue) >= self.max_queued:
            worst = self._queue[-1] if self._queue else None
            if worst is None or worst.key[0] <= t.priority:
                t.rejected = Rejection.QUEUE_FULL
                d.rejected.append(t)
                return t, d
            self._queue.pop()
            worst.rejected = Rejection.SHED
            d.rejected.append(worst)
        bisect.insort(self._queue, t, key=lambda x: x.key)
        self._pump(limit, d)
        return t, d

    def release(self, t: Ticket, now: float, limit: int) -> Decision:
        """An admitted request ended (any way); frees its slots and admits who fits."""
        d = Decision()
        if t.admitted:
            t.admitted = False
            self.inflight -= t.slots
            self._service_s = 0.9 * self._service_s + 0.1 * max(0.0, now - t.arrival)
        self._pump(limit, d)
        return d

    def cancel(self, t: Ticket, now: float, limit: int) -> Decision:
        """A queued request went away (client disconnect); an admitted one is released."""
        if t.admitted:
            return self.release(t, now, limit)
        i = bisect.bisect_left(self._queue, t.key, key=lambda x: x.key)
        if i < len(self._queue) and self._queue[i] is t:
            del self._queue[i]
        d = Decision()
        self._pump(limit, d)
        return d

    def expire(self, now: float, limit: int) -> Decision:
        """Refuse queued requests past their queue deadline; admit who fits (the limit may have
        grown with the workers)."""
        d = Decision()
        late = [t for t in self._queue if t.deadline <= now]
        if late:
            self._queue = [t for t in self._queue if t.deadline > now]
            for t in late:
                t.rejected = Rejection.QUEUE_TIMEOUT
            d.rejected.extend(late)
        self._pump(limit, d)
        return d

    def retry_after_s(self, limit: int) -> int:
        """Seconds a refused client should wait: about the time for the queue ahead to drain."""
        ahead = len(self._queue) + 1
        est = self._service_s * ahead / max(1, limit)
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(est)))

    def _fits(self, t: Ticket, limit: int) -> bool:
        return self.inflight + t.slots <= limit or (self.inflight == 0 and limit > 0)

    def _admit(self, t: Ticket, d: Decision) -> None:
        t.admitted = True
        self.inflight += t.slots
        d.admitted.append(t)

    def _pump(self, limit: int, d: Decision) -> None:
        while self._queue and self._fits(self._queue[0], limit):
            self._admit(self._queue.pop(0), d)


def capacity_limit(decode_seq_slots: list[int]) -> int:
    """The default in-flight limit from the decode pool's batch sizes (``max_num_seqs`` of each
    decode or colocated worker): ``SLOTS_PER_WORKER_SEQ`` sub-requests per sequence slot."""
    return SLOTS_PER_WORKER_SEQ * sum(decode_seq_slots)
