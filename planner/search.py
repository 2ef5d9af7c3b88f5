"""The deployment search behind ``tandem plan``: the cheapest deployment that meets the SLO.

Pure given its inputs (deterministic: every candidate is simulated on the same seed, so they
face the same requests). "Cheapest" is fewest workers, then the best margin (the smallest
slack of TTFT p90 and ITL p90 against their targets, relative). The disaggregated search walks
up from capacity lower bounds: client TTFT is the prefill's first token, so a TTFT miss adds a
prefill worker and an ITL miss a decode worker (an overloaded run grows the busier pool); from
the first deployment that meets the SLO it also tries the neighbours with one worker less or
moved. The colocated search adds workers until the SLO is met. Everything simulated is kept for
the Pareto table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tandem.engine.sim.profile import Profile
from tandem.planner.metrics import Percentiles, SimResult
from tandem.planner.simulator import Deployment, SimOptions, simulate
from tandem.planner.workload import Workload


@dataclass(frozen=True, slots=True)
class SLO:
    """p90 targets in seconds, judged in the client's view (guidellm's TTFT and per-request
    ITL) or the router's (its TTFT and ITL histograms, which the autoscaler reads)."""

    ttft_p90: float
    itl_p90: float
    view: str = "client"

    def __post_init__(self) -> None:
        if not (self.ttft_p90 > 0 and self.itl_p90 > 0):
            raise ValueError("SLO targets must be > 0 seconds")
        if self.view not in ("client", "router"):
            raise ValueError(f"the SLO view must be client or router, got {self.view!r}")

    def ttft(self, r: SimResult) -> Percentiles:
        return r.ttft if self.view == "client" else r.router_ttft

    def itl(self, r: SimResult) -> Percentiles:
        return r.itl if self.view == "client" else r.router_itl


@dataclass(frozen=True, slots=True)
class Candidate:
    deployment: Deployment
    result: SimResult
    slo: SLO

    @property
    def ttft_ratio(self) -> float:
        return self.slo.ttft(self.result).p90 / self.slo.ttft_p90

    @property
    def itl_ratio(self) -> float:
        itl = self.slo.itl(self.result)
        if itl.count == 0:  # one-token answers: no inter-token latency to miss
            return 0.0
        return itl.p90 / self.slo.itl_p90

    @property
    def meets(self) -> bool:
        return not self.result.overloaded and self.ttft_ratio <= 1 and self.itl_ratio <= 1

    @property
    def margin(self) -> float:
        """1 - the worse ratio: > 0 inside the SLO, larger is safer."""
        return 1.0 - max(self.ttft_ratio, self.itl_ratio)

    def key(self) -> tuple[int, float]:
        return (self.deployment.workers, -self.margin)

    def to_dict(self) -> dict:
        d, r = self.deployment, self.result
        return {
            "prefill": d.prefill, "decode": d.decode, "colocated": d.colocated,
            "workers": d.workers, "meets_slo": self.meets, "margin": _finite(self.margin),
            "predicted": predicted(r, self.slo),
        }  # fmt: skip


def _finite(v: float) -> float | None:
    return None if math.isinf(v) or math.isnan(v) else round(v, 6)


def predicted(r: SimResult, slo: SLO) -> dict:
    """The prediction fields of ``tandem plan --json`` (seconds; None where infinite): TTFT and
    ITL in the SLO's view, both views spelled out, and the pools' load."""
    ttft, itl = slo.ttft(r), slo.itl(r)
    return {
        "view": slo.view,
        "ttft_p90": _finite(ttft.p90), "ttft_p50": _finite(ttft.p50),
        "itl_p90": _finite(itl.p90), "itl_p50": _finite(itl.p50),
        "client": {"ttft_p90": _finite(r.ttft.p90), "itl_p90": _finite(r.itl.p90)},
        "router": {"ttft_p90": _finite(r.router_ttft.p90), "itl_p90": _finite(r.router_itl.p90)},
        "e2e_p90": _finite(r.e2e.p90), "output_tokens_per_s": round(r.output_tokens_per_s, 3),
        "overloaded": r.overloaded,
        "utilization": {k: round(p.utilization, 4) for k, p in r.pools.items()},
        "kv_usage_max": {k: round(p.max_kv_usage, 4) for k, p in r.pools.items()},
    }  # fmt: skip


@dataclass(slots=True)
class PlanResult:
    slo: SLO
    best: Candidate | None  # the cheapest deployment meeting the SLO (None: infeasible)
    best_disaggregated: Candidate | None
    best_colocated: Candidate | None
    closest: Candidate  # the best margin of all (the closest miss when infeasible)
    tried: list[Candidate] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.best is not None

    def pareto(self) -> list[Candidate]:
        """Per worker count, the best-margin deployment of each kind, sorted by workers."""
        best: dict[tuple[int, bool], Candidate] = {}
        for c in self.tried:
            k = (c.deployment.workers, c.deployment.colocated)
            if k not in best or c.margin > best[k].margin:
                best[k] = c
        return sorted(best.values(), key=lambda c: (c.deployment.workers, c.deployment.colocated))


class Planner:
    """Simulates candidates once each (memoised by split)."""

    def __init__(
        self,
        profile: Profile,
        workload: Workload,
        slo: SLO,
        base: Deployment,
        options: SimOptions = SimOptions(),
        max_workers: int = 16,
        on_candidate: Callable[[Candidate], None] = lambda _c: None,
        min_prefill: int = 0,
    ) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if min_prefill < 0 or min_prefill >= max_workers:
            raise ValueError("min_prefill must be in [0, max_workers)")
        # > 0: the deployment keeps a prefill pool (an operator's minReplicas): no colocated.
        self.min_prefill = min_prefill
        self.profile = profile
        self.workload = workload
        self.slo = slo
        self.base = base
        self.options = options
        self.max_workers = max_workers
        self._seen: dict[tuple[int, int], Candidate] = {}
        self._on_candidate = on_candidate

    def candidate(self, prefill: int, decode: int) -> Candidate:
        key = (prefill, decode)
        if key not in self._seen:
            dep = replace(self.base, prefill=prefill, decode=decode)
            c = Candidate(dep, simulate(self.profile, self.workload, dep, self.options), self.slo)
            self._seen[key] = c
            self._on_candidate(c)
        return self._seen[key]

    def lower_bounds(self) -> tuple[int, int]:
        """Capacity bounds (prefill, decode) from the cost model alone: busy time per second."""
        w, step = self.workload, self.profile.step
        budget = self.base.max_num_batched_tokens or self.profile.engine.max_num_batched_tokens
        chunk = min(budget, w.isl.mean)
        per_chunk = step.step_seconds([(chunk, 0)])
        prefill_busy = w.rate * per_chunk * (w.isl.mean * (1 - w.prefix_share) / chunk)
        # Decode: the largest batch whose step fits the ITL target, and its token rate.
        ctx = w.isl.mean + w.osl.mean // 2
        batch = 1
        while batch < 1024 and step.step_seconds([(1, ctx)] * (batch * 2)) <= self.slo.itl_p90:
            batch *= 2
        tokens_per_s = batch / step.step_seconds([(1, ctx)] * batch)
        decode_busy = w.rate * w.osl.mean / tokens_per_s
        return max(1, math.ceil(prefill_busy)), max(1, math.ceil(decode_busy))

    def search_disaggregated(self) -> Candidate | None:
        p, d = self.lower_bounds()
        p = max(p, self.min_prefill)
        found = None
        while p + d <= self.max_workers:
            c = self.candidate(p, d)
            if c.meets:
                found = c
                break
            grow_prefill = c.ttft_ratio > 1 and (c.ttft_ratio >= c.itl_ratio or c.itl_ratio <= 1)
            if c.result.overloaded and c.ttft_ratio <= 1 and c.itl_ratio <= 1:
                pools = c.result.pools
                grow_prefill = pools["prefill"].utilization >= pools["decode"].utilization
            if grow_prefill:
                p += 1
            else:
                d += 1
        if found is None:
            return None
        p, d = found.deployment.prefill, found.deployment.decode
        for dp, dd in ((-1, 0), (0, -1), (1, -1), (-1, 1)):
            if p + dp >= max(1, self.min_prefill) and d + dd >= 1:
                c = self.candidate(p + dp, d + dd)
                if c.meets and c.key() < found.key():
                    found = c
        return found

    def search_colocated(self) -> Candidate | None:
        p, d = self.lower_bounds()
        n = max(1, min(p + d - 1, self.max_workers))
        while n <= self.max_workers:
            c = self.candidate(0, n)
            if c.meets:
                if n > 1 and self.candidate(0, n - 1).meets:
                    n -= 1  # the bound overshot: walk down
                    continue
                return c
            n += 1
        return None

    def plan(self) -> PlanResult:
        dis = self.search_disaggregated() if self.max_workers >= 2 else None
        colo = self.search_colocated() if self.min_prefill == 0 else None
        feasible = [c for c in (dis, colo) if c is not None]
        best = min(feasible, key=Candidate.key) if feasible else None
        tried = list(self._seen.values())
        closest = max(tried, key=lambda c: (c.margin, -c.deployment.workers))
        return PlanResult(self.slo, best, dis, colo, closest, tried)
