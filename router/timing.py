"""Per-request latency metrics at the router: TTFT, ITL and end-to-end (DESIGN.md §9)."""

from __future__ import annotations

import time

from tandem.router.choice_output import TokenEvent
from tandem.router.metrics import RouterMetrics


class RequestTiming:
    """TTFT, ITL and end-to-end latency of one request.

    In P->D mode TTFT is taken at the first token from decode (covering prefill, KV transfer and
    the first decode step), although prefill's token already reached the client; ITL then measures
    decode steps only. TTFT is observed once per request, at its first choice to get there.
    """

    def __init__(self, metrics: RouterMetrics, arrival: float, num_choices: int) -> None:
        self._m = metrics
        self._arrival = arrival
        self._ttft_done = False
        self._last: list[float | None] = [None] * num_choices
        self._tokens = 0
        self._done = False

    def on_event(self, ev: TokenEvent) -> None:
        n = len(ev.token_ids)
        self._tokens += n
        if n == 0 and ev.finish_reason is None:
            return
        if ev.handoff:
            return  # wait for decode's first token
        now = time.monotonic()
        prev = self._last[ev.choice]
        if prev is None:
            if not self._ttft_done:
                self._ttft_done = True
                self._m.ttft.observe(now - self._arrival)
            n_itl = n - 1  # the first token of a choice has no inter-token gap before it
        else:
            n_itl = n
        if prev is not None and n_itl > 0:
            for _ in range(n_itl):
                self._m.itl.observe((now - prev) / n_itl)
        if n:
            self._last[ev.choice] = now

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._tokens:  # requests that failed before any output are not latency samples
            self._m.e2e.observe(time.monotonic() - self._arrival)
        self._m.generation_tokens.inc(self._tokens)
