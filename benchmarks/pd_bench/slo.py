"""SLOs from unloaded latencies, SLO attainment and goodput: pure functions over request records.

The SLOs are multiples of the unloaded latencies measured in the same run. Unloaded TTFT depends
on the prompt's length, so each deployment's calibration runs (one request at a time, prompts from
short to the longest the workloads send) give a TTFT profile over prompt length (``TtftProfile``:
linear between the measured points); a request's TTFT objective is ``ttft_x`` times the best
deployment's unloaded TTFT at its length (the lower envelope of the profiles). Unloaded ITL
depends on the context too (every decode step reads the whole context's KV: at 2 k tokens the
demo-sized model's step is ~1.5x its step at 32), so the same calibration gives an ITL profile
(``ItlProfile``: a least-squares line over prompt length, slope >= 0) of the per-request mean
inter-token latency (guidellm's ITL, which excludes the first token: vLLM's TPOT); a request's ITL
objective is ``itl_x`` times the lower envelope of those lines at its prompt length. One objective
for every deployment: a deployment that is slower unloaded (P/D pays for the KV transfer) is
judged by the same clock.

Goodput of a deployment on a workload: the highest offered request rate at which at least
``target`` of the requests meet both objectives; requests that did not finish (cancelled at the
run's time cap, or errored) count as missing them (a deployment cannot pass by leaving work
unfinished).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields


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


# The column order of a request row in the runner's JSON.
REQ_FIELDS = tuple(f.name for f in fields(Req))


@dataclass(slots=True, frozen=True)
class TtftProfile:
    """Unloaded TTFT as a function of prompt length: linear between calibration points, flat
    beyond them, made non-decreasing (a running max over length: a longer prompt is never faster
    unloaded, and a lower measurement is noise)."""

    points: tuple[tuple[int, float], ...]  # (prompt tokens, ms), by length, non-decreasing

    @classmethod
    def of(cls, samples: Sequence[tuple[int, float]]) -> TtftProfile:
        if not samples:
            raise ValueError("a TTFT profile needs at least one sample")
        pts: list[tuple[int, float]] = []
        best = -math.inf
        for n, t in sorted(samples):
            best = max(best, t)
            if pts and pts[-1][0] == n:
                pts[-1] = (n, best)
            else:
                pts.append((n, best))
        return cls(tuple(pts))

    def at(self, prompt_tokens: int) -> float:
        pts = self.points
        if prompt_tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if prompt_tokens <= n1:
                return t0 + (t1 - t0) * (prompt_tokens - n0) / (n1 - n0)
        return pts[-1][1]


@dataclass(slots=True, frozen=True)
class ItlProfile:
    """Unloaded ITL as a function of prompt length: the least-squares line through the
    calibration requests' (prompt tokens, mean ITL ms), its slope clamped at >= 0 (a longer
    context is never cheaper to decode; a falling fit is noise). A line, not TTFT's running max:
    one request's mean ITL over ~30 tokens is noisy, and a running max would keep the noisiest."""

    intercept_ms: float
    slope_ms_per_token: float

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> ItlProfile:
        if not samples:
            raise ValueError("an ITL profile needs at least one sample")
        n = len(samples)
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in samples)
        slope = sum((x - mx) * (y - my) for x, y in samples) / sxx if sxx > 0 else 0.0
        slope = max(0.0, slope)
        return cls(my - slope * mx, slope)

    def at(self, prompt_tokens: int) -> float:
        return self.intercept_ms + self.slope_ms_per_token * prompt_tokens


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of nothing")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass(slots=True, frozen=True)
class Unloaded:
    """One deployment's calibration: the TTFT and ITL profiles, and the median per-request ITL
    (reported; the SLO uses the profile)."""

    ttft: TtftProfile
    itl: ItlProfile
    itl_ms: float
    requests: int


def unloaded(reqs: Sequence[Req]) -> Unloaded:
    done = [r for r in reqs if r.completed and r.ttft_ms is not None]
    itls = [r.itl_ms for r in done if r.itl_ms is not None]
    if len(done) < 2 or not itls:
        raise ValueError(f"calibration needs >= 2 completed requests with ITL, got {len(done)}")
    profile = TtftProfile.of([(r.prompt_tokens, r.ttft_ms) for r in done])  # type: ignore[misc]
    itl = ItlProfile.fit([(r.prompt_tokens, r.itl_ms) for r in done if r.itl_ms is not None])
    return Unloaded(profile, itl, median(itls), len(done))


@dataclass(slots=True, frozen=True)
class Slo:
    """Per-request objectives from the lower envelopes of the unloaded profiles."""

    ttft_profiles: tuple[TtftProfile, ...]
    itl_profiles: tuple[ItlProfile, ...]
    ttft_x: float
    itl_x: float

    def ttft_ms(self, prompt_tokens: int) -> float:
        return self.ttft_x * min(f.at(prompt_tokens) for f in self.ttft_profiles)

    def itl_limit_ms(self, prompt_tokens: int) -> float:
        return self.itl_x * min(f.at(prompt_tokens) for f in self.itl_profiles)

    def meets(self, r: Req) -> bool:
        if not r.completed or r.ttft_ms is None:
            return False
        if r.ttft_ms > self.ttft_ms(r.prompt_tokens):
            return False
        return r.itl_ms is None or r.itl_ms <= self.itl_limit_ms(r.prompt_tokens)


def make_slo(refs: Sequence[Unloaded], ttft_x: float, itl_x: float) -> Slo:
    if not refs:
        raise ValueError("an SLO needs at least one unloaded reference")
    if ttft_x <= 0 or itl_x <= 0:
        raise ValueError("SLO multiples must be > 0")
    return Slo(tuple(u.ttft for u in refs), tuple(u.itl for u in refs), ttft_x, itl_x)


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
