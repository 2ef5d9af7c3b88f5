"""What a simulation predicts: per-request times and their distributions, per-pool load.

Two views of the same run:

- the client's, as guidellm reports it: TTFT = first token - send; ITL = (last token - first
  token) / (tokens - 1), per request (so it includes a P/D hand-off); end-to-end = last - send;
- the router's, as ``tandem_time_to_first_token_seconds`` and
  ``tandem_inter_token_latency_seconds`` record it (and so the autoscaler judges it): in P/D the
  TTFT waits for decode's first token (prefill, KV transfer, first decode step), and ITL is
  every gap between decode tokens (the hand-off gap excluded).

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestTrace:
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    path: str = ""  # the placement's prefill decision: colocated, remote, local_*
    finished: bool = False
    router_first: float | None = None  # first token not from a prefill hand-off

    @property
    def router_ttft(self) -> float | None:
        return None if self.router_first is None else self.router_first - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        if self.num_tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.last_token is None else self.last_token - self.arrival


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    a, b = sorted_values[lo], sorted_values[hi]
    if frac == 0 or a == b:
        return a
    return math.inf if math.isinf(b) else a + (b - a) * frac


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        v = sorted(values)
        if not v:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        return cls(len(v), sum(v) / len(v), percentile(v, 0.5), percentile(v, 0.9),
                   percentile(v, 0.99), v[-1])  # fmt: skip

    def to_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "p50": self.p50, "p90": self.p90,
                "p99": self.p99, "max": self.max}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolStats:
    workers: int
    utilization: float  # busy time / (workers x duration)
    mean_kv_usage: float
    max_kv_usage: float
    max_waiting: int
    steps: int
    preemptions: int
    # Seconds of the workers' steps (contention and the machine's pace included, the serving
    # work charged to them not): what their tandem_worker_busy_seconds_total would count.
    engine_seconds: float
    # Arrival at a worker to the first token it sampled (the workers' own TTFT histogram).
    first_token: Percentiles


@dataclass(frozen=True, slots=True)
class SimResult:
    total: int
    completed: int
    overloaded: bool  # stopped early: the queues grew past the simulator's bound
    duration: float  # virtual seconds from the first arrival to the last token
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    token_gap: Percentiles  # every gap the client sees
    router_ttft: Percentiles
    router_itl: Percentiles  # every gap between decode tokens
    output_tokens_per_s: float
    pools: Mapping[str, PoolStats]
    paths: Mapping[str, int]
    events: int
    wall_seconds: float
    traces: Sequence[RequestTrace] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.total, "completed": self.completed, "overloaded": self.overloaded,
            "duration_s": self.duration, "ttft_s": self.ttft.to_dict(), "itl_s": self.itl.to_dict(),
            "e2e_s": self.e2e.to_dict(), "token_gap_s": self.token_gap.to_dict(),
            "router_ttft_s": self.router_ttft.to_dict(),
            "router_itl_s": self.router_itl.to_dict(),
            "output_tokens_per_s": self.output_tokens_per_s,
            "pools": {name: {"workers": p.workers, "utilization": p.utilization,
                             "mean_kv_usage": p.mean_kv_usage, "max_kv_usage": p.max_kv_usage,
                             "max_waiting": p.max_waiting, "steps": p.steps,
                             "preemptions": p.preemptions,
                             "first_token_s": p.first_token.to_dict()}
                      for name, p in self.pools.items()},
            "paths": dict(self.paths), "events": self.events, "wall_s": self.wall_seconds,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Latencies:
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    token_gap: Percentiles
    router_ttft: Percentiles
    router_itl: Percentiles


def summarize_latencies(
    traces: Sequence[RequestTrace], gaps: Sequence[float], decode_gaps: Sequence[float]
) -> Latencies:
    """Both views over the traces: an unfinished request counts as infinite TTFT (if it has no
    token yet) and end-to-end, so an overloaded deployment never looks good."""
    done = [t for t in traces if t.finished]
    inf = math.inf
    ttft = [t.ttft if t.ttft is not None else inf for t in traces]
    router_ttft = [t.router_ttft if t.router_ttft is not None else inf for t in traces]
    e2e = [t.e2e if t.finished and t.e2e is not None else inf for t in traces]
    itl = [v for t in done if (v := t.itl) is not None]
    return Latencies(
        Percentiles.of(ttft), Percentiles.of(itl), Percentiles.of(e2e), Percentiles.of(gaps),
        Percentiles.of(router_ttft), Percentiles.of(decode_gaps),
    )  # fmt: skip
