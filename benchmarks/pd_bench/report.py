"""Markdown tables of a summary (what ``docs/benchmarks.md`` shows). Pure."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _pair(f: dict[str, Any], a: str, b: str, nd: int = 1) -> str:
    return f"{_fmt(f.get(a), nd)} / {_fmt(f.get(b), nd)}"


def workload_table(w: str, s: dict[str, Any], slo_names: list[str]) -> str:
    """One workload of one repeat: goodput per SLO setting and the fixed-load latencies."""
    head = ["deployment", *(f"goodput {n} (req/s)" for n in slo_names), "TTFT p50 / p90 ms",
            "TPOT p50 / p99 ms", "ITL/token p50 / p99 ms"]  # fmt: skip
    bursty = w == "bursty"
    if bursty:
        head += ["canary ITL p99 ms", "vs unloaded"]
    rows = []
    for d, v in s["deployments"].items():
        f = v.get("fixed", {})
        row = [d, *(_fmt(v["goodput_interpolated"][n]) for n in slo_names),
               _pair(f, "ttft_p50_ms", "ttft_p90_ms", 0), _pair(f, "tpot_p50_ms", "tpot_p99_ms"),
               _pair(f, "itl_token_p50_ms", "itl_token_p99_ms")]  # fmt: skip
        if bursty:
            row += [_fmt(f.get("canary_itl_p99_ms"), 1), _fmt(v.get("canary_p99_vs_unloaded"))]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for n in slo_names:
        bc, bp, ratio = s["best_colocated"].get(n), s["best_pd"].get(n), s["ratio"].get(n)
        if ratio is not None:
            verdict = f"**{_fmt(ratio)}x**"
        elif s.get("pd_only", {}).get(n):
            verdict = "**P/D only** (no colocated deployment meets it at any rate)"
        else:
            verdict = "**-** (neither meets it)"
        lines.append(f"\n{n}: best colocated {bc}, best P/D {bp}, P/D / best colocated "
                     f"{verdict}")  # fmt: skip
    return "\n".join(lines)


def markdown(summary: dict[str, Any]) -> str:
    names = [s["name"] for s in summary["slo_settings"]]
    out = []
    for i, rep in enumerate(summary["per_repeat"]):
        for w, s in rep["workloads"].items():
            out.append(f"### {w} (repeat {i + 1})\n\n{workload_table(w, s, names)}\n")
    out.append("### P/D / best colocated over the repeats\n")
    out.append("| workload | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    for w, by in summary["spread"].items():
        cells = []
        for n in names:
            sp = by.get(n, {})
            vals = ", ".join(_fmt(x) for x in sp.get("values", []))
            cell = f"{vals} (min {_fmt(sp.get('min'))}, max {_fmt(sp.get('max'))})"
            if sp.get("pd_only"):
                cell += f"; P/D only in {sp['pd_only']} of {len(sp.get('values', []))}"
            cells.append(cell)
        out.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
