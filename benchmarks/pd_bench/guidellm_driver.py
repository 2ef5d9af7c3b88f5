"""guidellm, the load generator: its command line (pure), one run as a subprocess, and its JSON
report read into ``slo.Req`` records.

Each run is one guidellm benchmark: a calibration (``synchronous``: one request at a time) or a
trace replay (a Poisson sweep point or the bursty trace). A replay sends every request of its
trace and waits for all of them, so no request is cut off at the end of a window and attainment
counts every request offered; ``max_duration`` caps an overloaded run's drain (what it cancels
counts as missing the SLO). guidellm runs with its working directory in the run folder
(its multiprocessing helpers put the working directory on ``sys.path``, and the repository root's
``operator/`` would shadow the standard library) and with ``PYTHONSAFEPATH=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_bench.slo import Req


@dataclass(slots=True, frozen=True)
class Target:
    url: str  # the router's base URL
    model: str  # the served model name
    tokenizer: str  # a local tokenizer directory


@dataclass(slots=True, frozen=True)
class Run:
    """One guidellm benchmark. ``data`` is a ``--data`` value; ``profile`` a ``--profile`` value;
    ``max_requests`` None means the data decides (a trace)."""

    data: str
    profile: str
    max_requests: int | None
    max_seconds: float


def guidellm_bin() -> str:
    """The ``guidellm`` next to this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("guidellm")
    found = str(here) if here.exists() else shutil.which("guidellm")
    if not found:
        raise RuntimeError("guidellm is not installed: pip install -e '.[bench]'")
    return found


def synchronous(data: str, requests: int, max_seconds: float) -> Run:
    return Run(data, "kind=synchronous", requests, max_seconds)


def replay(trace: Path, load: float, duration_s: float) -> Run:
    data = f"kind=trace_synthetic,source.kind=json_file,source.path={trace}"
    return Run(data, f"kind=replay,time_scale={round(1 / load, 6)},schedule_turn=timestamp", None,
               2 * duration_s / load + 60.0)  # fmt: skip


def argv(target: Target, run: Run, out_json: Path, guidellm: str, seed: int) -> list[str]:
    """The ``guidellm run`` command line: greedy decoding (the benchmark model's sampling outside
    printable ASCII would decode to nothing), exact output lengths (guidellm sends ``ignore_eos``),
    the JSON report only."""
    backend = (f"kind=openai_http,target={target.url}/v1,model={target.model},"
               "extras.body.temperature=0,timeout=600")  # fmt: skip
    args = [
        guidellm, "run", "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={target.tokenizer}",
        "--data", run.data, "--profile", run.profile,
        "--constraint", f"kind=max_duration,seconds={run.max_seconds}",
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]  # fmt: skip
    if run.max_requests is not None:
        args[-1:-1] = ["--constraint", f"kind=max_requests,count={run.max_requests}"]
    return args


def environment(base: dict[str, str], workers: int) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("GUIDELLM__")}
    # guidellm spawns 10 request workers by default: on a 2-core machine they would steal the
    # cores under test. OMP: guidellm imports torch and must not spread over every core.
    env.update(PYTHONSAFEPATH="1", GUIDELLM__MAX_WORKER_PROCESSES=str(workers),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    return env


def execute(target: Target, run: Run, workdir: Path, cpus: str | None, seed: int = 0,
            workers: int = 2) -> dict[str, Any]:  # fmt: skip
    """Run guidellm once (pinned to ``cpus`` when set); returns its JSON report. Raises with the
    log's tail when it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    out_json = workdir / "guidellm.json"
    cmd = argv(target, run, out_json, guidellm_bin(), seed)
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    log = workdir / "guidellm.log"
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, cwd=workdir, env=environment(dict(os.environ), workers),
                              stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=run.max_seconds + 300, check=False)  # fmt: skip
    if proc.returncode != 0 or not out_json.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"guidellm exited with {proc.returncode}:\n{tail}")
    return json.loads(out_json.read_text())


@dataclass(slots=True, frozen=True)
class Benchmark:
    """One benchmark of a guidellm report: its window and every request it sent."""

    strategy: str
    start: float
    end: float
    requests: tuple[Req, ...]
    errors: tuple[str, ...] = ()  # what guidellm recorded for each errored request


def _req(r: dict[str, Any], completed: bool) -> Req:
    t = r["info"]["timings"]
    start = t.get("request_start") or t.get("targeted_start") or 0.0
    return Req(
        start=float(start),
        prompt_tokens=int(r.get("prompt_tokens") or r["input_metrics"].get("text_tokens") or 0),
        output_tokens=int(r.get("output_tokens") or 0),
        ttft_ms=r.get("time_to_first_token_ms") if completed else None,
        itl_ms=r.get("inter_token_latency_ms") if completed else None,
        e2e_s=r.get("request_latency") if completed else None,
        completed=completed,
    )


def benchmarks(report: dict[str, Any]) -> list[Benchmark]:
    """The report's benchmarks with their requests: successful ones completed; incomplete
    (cancelled at the cap) and errored ones not."""
    out = []
    for b in report["benchmarks"]:
        reqs = b["requests"]
        records = [_req(r, True) for r in reqs.get("successful", [])]
        for bucket in ("incomplete", "errored"):
            records += [_req(r, False) for r in reqs.get(bucket, [])]
        records.sort(key=lambda r: r.start)
        strategy = b["config"]["strategy"]["type_"]
        errors = tuple(str(r["info"].get("error") or "")[:300] for r in reqs.get("errored", []))
        out.append(Benchmark(strategy, float(b["start_time"]), float(b["end_time"]),
                             tuple(records), errors))  # fmt: skip
    return out
