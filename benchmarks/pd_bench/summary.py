"""From the raw records of every repeat to the figures: SLOs, attainment curves, goodput, the
ratio P/D / best colocated, fixed-load latencies and the bursty ITL tail. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pd_bench.latency import histogram_quantile, percentile
from pd_bench.slo import (
    REQ_FIELDS,
    Req,
    Slo,
    Unloaded,
    attainment,
    goodput,
    goodput_interpolated,
    make_slo,
)
from pd_bench.slo import unloaded as fit_unloaded

# Prompt lengths at which the summary states each SLO's ITL objective.
SLO_LENGTHS = (32, 256, 1024, 2048)


@dataclass(slots=True, frozen=True)
class SloSetting:
    name: str
    ttft_x: float
    itl_x: float


def reqs_of(point: dict[str, Any]) -> list[Req]:
    return [Req(**dict(zip(REQ_FIELDS, row, strict=True))) for row in point["requests"]]


def canary_gaps(streams: Sequence[dict[str, Any]], start: float = -math.inf,
                end: float = math.inf) -> list[tuple[float, float]]:  # fmt: skip
    """(time, gap s) of every inter-chunk gap whose later chunk lands in [start, end]."""
    out = []
    for s in streams:
        c = s["chunks"]
        out += [(b, b - a) for a, b in zip(c, c[1:], strict=False) if start <= b <= end]
    return out


def _r(x: float, nd: int = 1) -> float | None:
    return None if x is None or math.isnan(x) else round(x, nd)


def fixed_stats(point: dict[str, Any]) -> dict[str, Any]:
    reqs = reqs_of(point)
    done = [r for r in reqs if r.completed]
    ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
    itl = [r.itl_ms for r in done if r.itl_ms is not None]
    buckets = [(float(le), c) for le, c in point["router_itl_buckets"]]
    out = {
        "rate": point["x"], "requests": len(reqs), "completed": len(done),
        "ttft_p50_ms": _r(percentile(ttft, 50)), "ttft_p90_ms": _r(percentile(ttft, 90)),
        "tpot_p50_ms": _r(percentile(itl, 50), 2), "tpot_p99_ms": _r(percentile(itl, 99), 2),
        "itl_token_p50_ms": _r(histogram_quantile(0.5, buckets) * 1e3, 2),
        "itl_token_p99_ms": _r(histogram_quantile(0.99, buckets) * 1e3, 2),
    }  # fmt: skip
    if "canary" in point:
        gaps = [g * 1e3 for _, g in canary_gaps(point["canary"], point["start"], point["end"])]
        out["canary_itl_p50_ms"] = _r(percentile(gaps, 50), 2)
        out["canary_itl_p99_ms"] = _r(percentile(gaps, 99), 2)
        out["canary_itl_max_ms"] = _r(max(gaps, default=math.nan), 1)
    return out


def worker_stats(metrics: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """Per worker over [start, end] from the sampled series: the deepest queue, the highest KV
    usage, and the KV bytes moved and mean seconds per transfer (counter deltas)."""
    out: dict[str, Any] = {}
    for name, series in metrics.items():
        if name == "router":
            continue
        rows = [v for t, v in zip(series["times"], series["values"], strict=True)
                if start <= t <= end]  # fmt: skip
        if not rows:
            continue

        def delta(key: str, rows: list[dict[str, float]] = rows) -> float:
            return rows[-1].get(key, 0.0) - rows[0].get(key, 0.0)

        n = delta("tandem_kv_transfer_seconds_count")
        out[name] = {
            "max_waiting": max(r.get("tandem_requests_waiting", 0.0) for r in rows),
            "max_running": max(r.get("tandem_requests_running", 0.0) for r in rows),
            "max_kv_usage": round(max(r.get("tandem_kv_cache_usage_ratio", 0.0) for r in rows), 4),
            "kv_transfer_bytes": delta("tandem_kv_transfer_bytes_total"),
            "kv_transfer_mean_ms": round(delta("tandem_kv_transfer_seconds_sum") / n * 1e3, 2)
            if n > 0 else None,
            "preemptions": delta("tandem_preemptions_total"),
        }  # fmt: skip
    return out


def _best(goodputs: dict[str, float], kinds: dict[str, str], want: tuple[str, ...]) -> str | None:
    cands = [(g, d) for d, g in goodputs.items() if kinds[d] in want]
    return max(cands)[1] if cands else None


def summarize_repeat(records: list[dict[str, Any]], settings: Sequence[SloSetting],
                     target: float, fixed: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """One repeat. ``fixed`` maps a workload to the rate whose distributions are reported."""
    kinds = {r["deployment"]: r["kind"] for r in records}
    refs: dict[str, Unloaded] = {}
    for rec in records:
        cal = [r for p in rec["points"] if p["workload"] == "calibration" for r in reqs_of(p)]
        try:
            refs[rec["deployment"]] = fit_unloaded(cal)
        except ValueError:
            pass
    out: dict[str, Any] = {
        "unloaded": {d: {"ttft_ms_by_prompt": [[n, round(t, 1)] for n, t in u.ttft.points],
                         "itl_ms": round(u.itl_ms, 2),
                         "itl_fit": [round(u.itl.intercept_ms, 3),
                                     round(u.itl.slope_ms_per_token, 6)]}
                     for d, u in refs.items()},
        "workloads": {},
    }  # fmt: skip
    if not refs:
        return out
    slos: dict[str, Slo] = {s.name: make_slo(list(refs.values()), s.ttft_x, s.itl_x)
                            for s in settings}  # fmt: skip
    workloads = sorted({p["workload"] for r in records for p in r["points"]} - {"calibration"})
    for w in workloads:
        deps: dict[str, Any] = {}
        for rec in records:
            pts = sorted((p for p in rec["points"] if p["workload"] == w), key=lambda p: p["x"])
            if not pts:
                continue
            curves = {n: [[p["x"], round(attainment(reqs_of(p), slo), 4)] for p in pts]
                      for n, slo in slos.items()}  # fmt: skip
            d = {
                "curve": curves,
                "goodput": {n: goodput([tuple(c) for c in cv], target) for n, cv in curves.items()},
                "goodput_interpolated": {
                    n: round(goodput_interpolated([tuple(c) for c in cv], target), 4)
                    for n, cv in curves.items()
                },
            }  # fmt: skip
            at = [p for p in pts if abs(p["x"] - fixed.get(w, math.nan)) < 1e-9]
            if at:
                d["fixed"] = fixed_stats(at[0])
                if rec.get("metrics"):
                    d["fixed"]["workers"] = worker_stats(rec["metrics"], at[0]["start"],
                                                         at[0]["end"])  # fmt: skip
            if w == "bursty" and rec.get("canary_unloaded"):
                un = [g * 1e3 for _, g in canary_gaps(rec["canary_unloaded"])]
                d["canary_unloaded_itl_p99_ms"] = _r(percentile(un, 99), 2)
                if "fixed" in d and d["fixed"].get("canary_itl_p99_ms") and un:
                    d["canary_p99_vs_unloaded"] = round(
                        d["fixed"]["canary_itl_p99_ms"] / percentile(un, 99), 2
                    )
            deps[rec["deployment"]] = d
        # ratio: None where the best colocated goodput is 0; pd_only: P/D > 0 there (it meets
        # the SLO at some offered rate where no colocated deployment does at any).
        summary: dict[str, Any] = {"deployments": deps, "slo": {}, "best_colocated": {},
                                   "best_pd": {}, "ratio": {}, "pd_only": {}}  # fmt: skip
        for n, slo in slos.items():
            summary["slo"][n] = {"ttft_x": slo.ttft_x, "itl_x": slo.itl_x,
                                 "itl_ms_by_prompt": [[n, round(slo.itl_limit_ms(n), 2)]
                                                      for n in SLO_LENGTHS]}  # fmt: skip
            g = {dn: dv["goodput_interpolated"][n] for dn, dv in deps.items()}
            bc = _best(g, kinds, ("colocated", "colocated-x2"))
            bp = _best(g, kinds, ("pd",))
            summary["best_colocated"][n] = bc
            summary["best_pd"][n] = bp
            if bc and bp:
                summary["ratio"][n] = round(g[bp] / g[bc], 3) if g[bc] > 0 else None
                summary["pd_only"][n] = g[bc] == 0 and g[bp] > 0
        out["workloads"][w] = summary
    return out


def spread(per_repeat: list[dict[str, Any]]) -> dict[str, Any]:
    """Each workload's P/D / best-colocated ratio per SLO setting over the repeats."""
    out: dict[str, Any] = {}
    for rep in per_repeat:
        for w, s in rep["workloads"].items():
            for n, ratio in s["ratio"].items():
                e = out.setdefault(w, {}).setdefault(n, {"values": [], "pd_only": 0})
                e["values"].append(ratio)
                e["pd_only"] += bool(s.get("pd_only", {}).get(n))
    return {w: {n: {"values": e["values"],
                    "min": min((x for x in e["values"] if x is not None), default=None),
                    "max": max((x for x in e["values"] if x is not None), default=None),
                    "pd_only": e["pd_only"]}
                for n, e in by.items()} for w, by in out.items()}  # fmt: skip
