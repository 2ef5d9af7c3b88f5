"""The figures (matplotlib PNGs): attainment vs offered rate per workload, TTFT and ITL CDFs at
the fixed load, and the canary's ITL timeline through the bursts. Reads the first repeat's raw
records and the summary; headless (Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pd_bench.latency import cdf  # noqa: E402
from pd_bench.summary import canary_gaps, reqs_of  # noqa: E402

FILES = ("pd_goodput.png", "pd_ttft_cdf.png", "pd_itl_cdf.png", "pd_itl_timeline.png")


def _style(kind: str) -> str:
    return {"pd": "-", "colocated-x2": "--"}.get(kind, ":")


def goodput_curves(summary: dict[str, Any], kinds: dict[str, str], slo: str, target: float,
                   path: Path) -> None:  # fmt: skip
    rep = summary["per_repeat"][0]["workloads"]
    fig, axes = plt.subplots(1, max(1, len(rep)), figsize=(5 * max(1, len(rep)), 4), squeeze=False)
    for ax, (w, s) in zip(axes[0], rep.items(), strict=False):
        for d, v in s["deployments"].items():
            xs, ys = zip(*v["curve"][slo], strict=True) if v["curve"][slo] else ((), ())
            ax.plot(xs, [100 * y for y in ys], _style(kinds.get(d, "")), marker="o", label=d)
        ax.axhline(100 * target, color="grey", lw=0.8)
        ax.set(title=f"{w}: SLO attainment ({slo})", xlabel="offered rate (req/s)",
               ylabel="requests within SLO (%)", ylim=(0, 105))  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fixed_point(rec: dict[str, Any], w: str, rate: float) -> dict[str, Any] | None:
    return next((p for p in rec["points"] if p["workload"] == w and abs(p["x"] - rate) < 1e-9),
                None)  # fmt: skip


def cdfs(records: list[dict[str, Any]], fixed: dict[str, float], metric: str, path: Path) -> None:
    """``metric`` "ttft" (guidellm, ms) or "itl" (the canary's per-chunk gaps for bursty,
    guidellm's per-request mean ITL otherwise)."""
    ws = [w for w in fixed if any(_fixed_point(r, w, fixed[w]) for r in records)]
    fig, axes = plt.subplots(1, max(1, len(ws)), figsize=(5 * max(1, len(ws)), 4), squeeze=False)
    for ax, w in zip(axes[0], ws, strict=False):
        label = "TTFT (ms)" if metric == "ttft" else "ITL (ms)"
        for rec in records:
            p = _fixed_point(rec, w, fixed[w])
            if p is None:
                continue
            done = [r for r in reqs_of(p) if r.completed]
            if metric == "ttft":
                xs = [r.ttft_ms for r in done if r.ttft_ms is not None]
            elif "canary" in p:
                xs = [g * 1e3 for _, g in canary_gaps(p["canary"], p["start"], p["end"])]
                label = "ITL per chunk, canary (ms)"
            else:
                xs = [r.itl_ms for r in done if r.itl_ms is not None]
                label = "mean ITL per request (ms)"
            x, y = cdf(xs)
            ax.step(x, y, _style(rec["kind"]), where="post", label=rec["deployment"])
        ax.set(title=f"{w} at {fixed[w]:g} req/s", xlabel=label, ylabel="CDF", xscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(records: list[dict[str, Any]], rate: float, burst_prompt: int, path: Path) -> None:
    recs = [(r, _fixed_point(r, "bursty", rate)) for r in records]
    recs = [(r, p) for r, p in recs if p is not None and p.get("canary")]
    fig, axes = plt.subplots(max(1, len(recs)), 1, figsize=(10, 1.8 * max(1, len(recs)) + 0.6),
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, (rec, p) in zip(axes[:, 0], recs, strict=False):
        gaps = canary_gaps(p["canary"], p["start"], p["end"])
        ax.scatter([t - p["start"] for t, _ in gaps], [g * 1e3 for _, g in gaps], s=3)
        for r in reqs_of(p):
            if r.prompt_tokens >= burst_prompt * 0.9:
                ax.axvline(r.start - p["start"], color="red", lw=0.5, alpha=0.5)
        ax.set_yscale("log")
        ax.set_ylabel(f"{rec['deployment']}\nITL ms", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds into the run (red: a long prompt arrives)")
    fig.suptitle(f"ITL canary through bursts (bursty workload, {rate:g} req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(records: list[dict[str, Any]], summary: dict[str, Any], fixed: dict[str, float],
              out_dir: Path, slo: str, target: float, burst_prompt: int) -> list[Path]:  # fmt: skip
    """The four figures from the first repeat; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    first = [r for r in records if r.get("repeat", 0) == 0 and r["points"]]
    kinds = {r["deployment"]: r["kind"] for r in records}
    paths = [out_dir / f for f in FILES]
    goodput_curves(summary, kinds, slo, target, paths[0])
    cdfs(first, fixed, "ttft", paths[1])
    cdfs(first, fixed, "itl", paths[2])
    timeline(first, fixed.get("bursty", -1.0), burst_prompt, paths[3])
    return paths
