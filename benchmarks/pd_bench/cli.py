"""The runner's command line; ``benchmarks/pd_vs_colocated.py`` calls ``main``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.machine import machine
from benchlib.model import write_chat_llama

from pd_bench import deployments, plots, report, runner, summary
from pd_bench.workloads import MODEL_CONTEXT, WORKLOADS, Bursty, Synthetic

GUIDELLM_OVERHEAD_S = 12.0  # per guidellm run: worker processes start, report compiles
STARTUP_S = 25.0  # per deployment: processes start, model loads, warm-up


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _slo(text: str) -> summary.SloSetting:
    try:
        name, t, i = text.split(":")
        return summary.SloSetting(name, float(t), float(i))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slo takes NAME:TTFT_X:ITL_X, got {text!r}") from None


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    a = p.add_argument
    a("--duration", type=float, default=20.0, help="seconds of load per sweep point")
    a("--repeats", type=int, default=2)
    a("--repeat-all", action="store_true",
      help="run every deployment in every repeat (default: repeats after the first run the "
           "finalists: the best colocated and best P/D per workload, and colo2)")  # fmt: skip
    a("--deployments", default=None, help="comma-separated names (default: all)")
    a("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    a("--budgets", type=_ints, default=(128, 256, 512, 2048), help="colocated token budgets")
    a("--colo2-budget", type=int, default=512, help="token budget of each colo2 worker")
    a("--thresholds", type=_ints, default=(0, 64),
      help="P/D --local-prefill-threshold values (64: the operator's default)")  # fmt: skip
    a("--transports", default="tcp,ucx")
    a("--cpus", default="0,1", help="the two worker cores")
    a(
        "--aux-cpus",
        default=None,
        help="router + guidellm + canary cores (default: a third core if any, else the first)",
    )
    a("--rate-scale", type=float, default=1.0, help="multiply every workload's rates")
    a(
        "--rates",
        action="append",
        default=[],
        metavar="WORKLOAD=R1,R2,...",
        help="replace a synthetic workload's rates (or the bursty loads)",
    )
    a("--min-requests", type=int, default=8, help="per Poisson point, whatever its duration")
    a("--calibration-requests", type=int, default=8)
    a("--canary-alone", type=float, default=15.0, help="seconds of the canary's unloaded run")
    a("--slo", type=_slo, action="append", default=None, metavar="NAME:TTFT_X:ITL_X",
      help="SLO as multiples of the unloaded TTFT and ITL (repeatable; default "
           "tight-itl:5:1.5 and relaxed:10:3)")  # fmt: skip
    a("--target", type=float, default=0.9, help="attainment that counts as goodput")
    a("--model-dir", default=None,
      help="default: a random chat Llama (4096 positions: prompts reach 2 k plus the output) in "
           "a temp dir")  # fmt: skip
    a("--hidden", type=int, default=384)
    a("--layers", type=int, default=6)
    a("--seed", type=int, default=0)
    a("--json", default="pd_vs_colocated.json")
    a("--plots-dir", default="docs/img")
    a("--markdown", default=None, help="also write the tables here")
    a("--estimate", action="store_true", help="print the estimated wall time and exit")
    return p


def select_workloads(args: argparse.Namespace) -> tuple[Synthetic | Bursty, ...]:
    chosen = []
    overrides = dict(r.split("=", 1) for r in args.rates)
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        w = WORKLOADS[name]
        if name in overrides:
            vals = tuple(sorted(float(x) for x in overrides[name].split(",")))
            if isinstance(w, Synthetic):
                w = dataclasses.replace(w, rates=vals, fixed=min(w.fixed, len(vals) - 1))
            elif 1.0 not in vals:
                raise SystemExit("bursty loads must include 1.0 (the fixed point)")
            else:
                w = dataclasses.replace(w, loads=vals)
        chosen.append(w)
    return tuple(chosen)


def fixed_rates(ws: tuple[Synthetic | Bursty, ...], scale: float) -> dict[str, float]:
    out = {}
    for w in ws:
        if isinstance(w, Synthetic):
            out[w.name] = w.scaled(scale)[w.fixed]
        else:
            out[w.name] = round(w.rate(1.0) * scale, 4)
    return out


def estimate_s(ws: tuple[Synthetic | Bursty, ...], n_first: int, n_later: int, repeats: int,
               s: runner.Settings) -> float:  # fmt: skip
    per = STARTUP_S + (s.calibration_requests + 3) * 1.5 + 2 * GUIDELLM_OVERHEAD_S
    for w in ws:
        if isinstance(w, Synthetic):
            per += sum(max(s.duration_s, s.min_requests / (r * s.rate_scale))
                       + GUIDELLM_OVERHEAD_S + 5 for r in w.rates)  # fmt: skip
        else:
            per += s.canary_alone_s + sum(s.duration_s / (ld * s.rate_scale)
                                          + GUIDELLM_OVERHEAD_S + 5 for ld in w.loads)  # fmt: skip
    return per * (n_first + n_later * max(0, repeats - 1))


def finalists(rep_summary: dict[str, Any], specs: list[deployments.DeploymentSpec]) -> list:
    keep = {"colo2"}
    for w in rep_summary["workloads"].values():
        keep |= {d for d in (*w["best_colocated"].values(), *w["best_pd"].values()) if d}
    return [s for s in specs if s.name in keep]


def main(doc: str | None = None) -> int:
    args = parser(doc).parse_args()
    slos = args.slo or [
        summary.SloSetting("tight-itl", 5, 1.5),
        summary.SloSetting("relaxed", 10, 3),
    ]
    ws = select_workloads(args)
    a, _ = deployments.cores(args.cpus)
    aux = args.aux_cpus or (str(max(int(c) for c in args.cpus.split(",")) + 1)
                            if (os.cpu_count() or 1) > 2 else a)  # fmt: skip
    names = args.deployments.split(",") if args.deployments else None
    specs = deployments.build(names, args.cpus, aux, args.budgets, args.colo2_budget,
                              args.thresholds, tuple(args.transports.split(",")))  # fmt: skip
    settings = runner.Settings(
        args.model_dir or "", args.duration, args.min_requests, args.rate_scale,
        args.calibration_requests,
        args.canary_alone, aux, args.seed, ws,
    )  # fmt: skip
    later = len(specs) if args.repeat_all else min(len(specs), 3)
    est = estimate_s(ws, len(specs), later, args.repeats, settings)
    print(f"pd_vs_colocated: {len(specs)} deployments x {len(ws)} workloads, {args.repeats} "
          f"repeat(s); estimated wall time {est / 60:.0f} min",
          file=sys.stderr, flush=True)  # fmt: skip
    if args.estimate:
        return 0
    if not args.model_dir:
        out = Path(tempfile.mkdtemp(prefix="tandem-bench-pd-model-"))
        settings = dataclasses.replace(
            settings,
            model_dir=str(write_chat_llama(out, args.hidden, args.layers, context=MODEL_CONTEXT)),
        )
    note = machine()
    t0 = time.time()
    records: list[dict[str, Any]] = []
    per_repeat: list[dict[str, Any]] = []
    fixed = fixed_rates(ws, args.rate_scale)
    todo = specs
    for rep in range(args.repeats):
        recs = runner.run_repeat(todo, settings, rep)
        records += recs
        per_repeat.append(summary.summarize_repeat(recs, slos, args.target, fixed))
        if rep == 0 and not args.repeat_all:
            todo = finalists(per_repeat[0], specs)
    summ = {"slo_settings": [dataclasses.asdict(s) for s in slos], "target": args.target,
            "fixed_rates": fixed, "per_repeat": per_repeat,
            "spread": summary.spread(per_repeat)}  # fmt: skip
    burst = next((w.burst_prompt for w in ws if isinstance(w, Bursty)), 10**9)
    pngs = plots.write_all(records, summ, fixed, Path(args.plots_dir), slos[0].name,
                           args.target, burst)  # fmt: skip
    out = {
        "machine": note, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "placement": {"worker_cpus": args.cpus, "aux_cpus": aux,
                      "aux": "router, guidellm and the ITL canary"},
        "settings": {k: v for k, v in dataclasses.asdict(settings).items()
                     if k not in ("workloads", "log")},
        "workloads": [dataclasses.asdict(w) for w in ws],
        "deployments": [{"name": s.name, "kind": s.kind, "engine_options": s.engine_options,
                         "local_prefill_threshold": s.local_prefill_threshold,
                         "kv_transport": s.kv_transport,
                         "placement": dataclasses.asdict(s.placement)} for s in specs],
        "estimate_s": round(est), "wall_s": round(time.time() - t0),
        "plots": [str(p) for p in pngs], "summary": summ, "records": records,
    }  # fmt: skip
    Path(args.json).write_text(json.dumps(out) + "\n")
    md = report.markdown(summ)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    print(f"pd_vs_colocated: {out['wall_s'] / 60:.1f} min; JSON {args.json}; plots "
          f"{', '.join(out['plots'])}", file=sys.stderr)  # fmt: skip
    return 0
