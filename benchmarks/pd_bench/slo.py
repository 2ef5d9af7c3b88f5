"""SLOs from unloaded latencies, SLO attainment and goodput: pure functions over request records.

The SLOs are multiples of the unloaded latencies measured in the same run. Unloaded TTFT depends
on the prompt's length, so each deployment's calibration run (one request at a time, prompts from
short to the longest the workloads send) is fitted as ``ttft = a + b * prompt_tokens``; a request's
TTFT objective is ``ttft_x`` times the best deployment's prediction for its length (the lower
envelope of the fitted lines), its ITL objective ``itl_x`` times the best unloaded median of the
per-request mean inter-token latency (guidellm's ITL, which excludes the first token: vLLM's
TPOT). One objective for every deployment: a deployment that is slower unloaded (P/D pays for the
KV transfer) is judged by the same clock.

Goodput of a deployment on a workload: the highest offered request rate at which at least
``target`` of the requests meet both objectives; requests that did not finish inside the
measurement window count as missing them (a deployment cannot pass by leaving work unfinished).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Req:
    """One request as guidellm measured it. ``ttft_ms``/``itl_ms`` are None when it did not
    complete (errored or still running when the window closed); ``itl_ms`` also for one token."""

    start: float  # unix time the request was sent
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None
    itl_ms: float | None
    e2e_s: float | None
    completed: bool


@dataclass(slots=True, frozen=True)
class LinearFit:
    a: float  # ms
    b: float  # ms per prompt token

    def at(self, prompt_tokens: int) -> float:
        return self.a + self.b * prompt_tokens


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least squares ``y = a + b x``; one distinct x gives a flat line through the mean. The slope
    is floored at 0 (unloaded TTFT does not fall as prompts grow; a negative fit is noise)."""
    if not xs or len(xs) != len(ys):
        raise ValueError("fit_line needs equally many xs and ys, at least one")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return LinearFit(my, 0.0)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    return LinearFit(my - b * mx, b)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of nothing")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass(slots=True, frozen=True)
class Unloaded:
    """One deployment's calibration: the TTFT line and the median per-request ITL."""

    ttft: LinearFit
    itl_ms: float
    requests: int


def unloaded(reqs: Sequence[Req]) -> Unloaded:
    done = [r for r in reqs if r.completed and r.ttft_ms is not None]
    itls = [r.itl_ms for r in done if r.itl_ms is not None]
    if len(done) < 2 or not itls:
        raise ValueError(f"calibration needs >= 2 completed requests with ITL, got {len(done)}")
    fit = fit_line([r.prompt_tokens for r in done], [r.ttft_ms for r in done])  # type: ignore[misc]
    return Unloaded(fit, median(itls), len(done))


@dataclass(slots=True, frozen=True)
class Slo:
    """Per-request objectives: TTFT from the lower envelope of the unloaded lines."""

    ttft_lines: tuple[LinearFit, ...]
    itl_ms: float
    ttft_x: float
    itl_x: float

    def ttft_ms(self, prompt_tokens: int) -> float:
        return self.ttft_x * min(f.at(prompt_tokens) for f in self.ttft_lines)

    def itl_limit_ms(self) -> float:
        return self.itl_x * self.itl_ms

    def meets(self, r: Req) -> bool:
        if not r.completed or r.ttft_ms is None:
            return False
        if r.ttft_ms > self.ttft_ms(r.prompt_tokens):
            return False
        return r.itl_ms is None or r.itl_ms <= self.itl_limit_ms()


def make_slo(refs: Sequence[Unloaded], ttft_x: float, itl_x: float) -> Slo:
    if not refs:
        raise ValueError("an SLO needs at least one unloaded reference")
    if ttft_x <= 0 or itl_x <= 0:
        raise ValueError("SLO multiples must be > 0")
    return Slo(tuple(u.ttft for u in refs), min(u.itl_ms for u in refs), ttft_x, itl_x)


def attainment(reqs: Sequence[Req], slo: Slo) -> float:
    """Fraction of ``reqs`` meeting ``slo`` (0 for no requests: nothing was served)."""
    return sum(slo.meets(r) for r in reqs) / len(reqs) if reqs else 0.0


def goodput(points: Sequence[tuple[float, float]], target: float) -> float:
    """Highest rate whose attainment is >= ``target``, from (rate, attainment) points, with every
    lower rate passing too (a pass above a failure is noise, not capacity); 0 when the lowest
    rate fails."""
    best = 0.0
    for rate, att in sorted(points):
        if att < target:
            break
        best = rate
    return best


def goodput_interpolated(points: Sequence[tuple[float, float]], target: float) -> float:
    """Where attainment crosses ``target``, linear between the last passing and the first failing
    rate; the highest rate when none fails, 0 when the lowest fails."""
    pts = sorted(points)
    prev: tuple[float, float] | None = None
    for rate, att in pts:
        if att < target:
            if prev is None:
                return 0.0
            r0, a0 = prev
            return r0 + (rate - r0) * (a0 - target) / (a0 - att)
        prev = (rate, att)
    return pts[-1][0] if pts else 0.0
