"""The asyncio side of admission control: a request awaits its turn here (``admission.py`` makes
every decision). Owned by ``RouterState``; ``serving.handle_generation`` calls ``admit`` before
the flow and ``release`` when the response ended, however it ended.

A refusal is a 429 with ``Retry-After`` and an OpenAI error object (type
``rate_limit_error``). Metrics: ``tandem_router_queue_depth`` and
``tandem_router_rejections_total{reason}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tandem.router.admission import Admission, Decision, Rejection, Ticket
from tandem.router.errors import OpenAIError
from tandem.router.metrics import RouterMetrics

_MESSAGES = {
    Rejection.QUEUE_FULL: "The server is at capacity and its queue is full; retry later.",
    Rejection.SHED: "The server is at capacity; this request gave its place to a higher-priority "
    "one. Retry later.",
    Rejection.QUEUE_TIMEOUT: "The server is at capacity; this request waited too long for a "
    "slot. Retry later.",
}
_TICK_S = 0.1  # how often a non-empty queue checks deadlines and a changed capacity


class AdmissionGate:
    """Not thread-safe: the router's event loop only. ``limit`` gives the current in-flight
    limit (configured, or derived from the registered workers)."""

    def __init__(
        self,
        admission: Admission,
        limit: Callable[[], int],
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._adm = admission
        self._limit = limit
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._ticker: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        return self._adm.depth

    @property
    def inflight(self) -> int:
        return self._adm.inflight

    async def admit(self, priority: int, slots: int) -> Ticket:
        """Wait for the request's turn; raises the 429 OpenAIError when refused. Cancelling the
        wait (client gone) gives the place up."""
        t, d = self._adm.offer(priority, slots, self._clock(), self._limit())
        self._apply(d)
        if t.rejected is not None:
            raise self._refusal(t.rejected)
        if t.admitted:
            return t
        fut = asyncio.get_running_loop().create_future()
        self._waiters[t] = fut
        self._ensure_ticker()
        try:
            await fut
        except asyncio.CancelledError:
            self._waiters.pop(t, None)
            self._apply(self._adm.cancel(t, self._clock(), self._limit()))
            raise
        if t.rejected is not None:
            raise self._refusal(t.rejected)
        return t

    def release(self, t: Ticket) -> None:
        self._apply(self._adm.release(t, self._clock(), self._limit()))

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    def _refusal(self, reason: Rejection) -> OpenAIError:
        retry = self._adm.retry_after_s(max(1, self._limit()))
        return OpenAIError(
            429, _MESSAGES[reason], code=reason.value, headers={"Retry-After": str(retry)}
        )

    def _apply(self, d: Decision) -> None:
        for t in d.admitted:
            fut = self._waiters.pop(t, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for t in d.rejected:
            assert t.rejected is not None
            self._metrics.rejection(t.rejected.value)
            fut = self._waiters.pop(t, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._metrics.queue_depth.set(self._adm.depth)
        self._metrics.inflight.set(self._adm.inflight)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self._adm.depth:
            await asyncio.sleep(_TICK_S)
            self._apply(self._adm.expire(self._clock(), self._limit()))
