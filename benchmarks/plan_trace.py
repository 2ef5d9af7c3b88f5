"""One validation case, request by request: the real `tandem up` beside the simulator.

``plan_validation.py`` judges a case by two p90s. When one misses, the question is which
requests made the difference and why: a p90 of 20-70 requests is set by its top few. This
replays one case's requests (the same generator and seed as ``plan_validation.py``) on a fresh
`tandem up` ``--repeats`` times (fresh each time: a second replay on the same workers would hit
the prefix cache the first one filled), simulates them with the given profile, and prints for
every request, in arrival order, the simulated TTFT and ITL beside each replay's, then the p90s,
each replay's step pace (the workers' busy seconds over the simulator's step seconds) and how
many requests ran more than 25 % over the simulator's ITL.

    python benchmarks/plan_trace.py --model random-512 --profile /tmp/pv/profile-random-512.json \\
        --workload prefill-heavy --load light --deployment colocated --duration 30

Round 36 of docs/planning.md used it on random-512's colocated prefill-heavy case at light
load: the requests that set its measured ITL p90 were those whose decode ran into the next
arrival's prefill because their own prefill had run slow.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plan_validation import (
    DEPLOYMENTS,
    _busy,
    _p90,
    _simulate,
    case_requests,
    case_workload,
    engine_seconds,
    model_path,
    rates,
    up_args,
    workloads,
)
from replay_load import Measured, replay

from tandem.calibrate import LocalUp
from tandem.engine.cpu_threads import available_cpus
from tandem.engine.sim.profile import load_profile
from tandem.planner.metrics import RequestTrace
from tandem.planner.workload import Workload, WorkloadRequest

OVER = 1.25  # a replayed request "over" the simulator: its ITL above this multiple of the sim's


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request: its arrival, the simulator's TTFT and ITL, and each replay's (None where
    that replay's request failed or streamed one token)."""

    arrival: float
    sim_ttft: float | None
    sim_itl: float | None
    real: tuple[tuple[float | None, float | None], ...]


def join(traces: Sequence[RequestTrace], replays: Sequence[Sequence[Measured]]) -> list[TraceRow]:
    """The simulator's traces and each replay's measurements, request by request. Both follow
    the requests' arrival order (``replay`` answers in request order; traces are sorted here,
    stably, so requests arriving together keep the simulator's order)."""
    ordered = sorted(traces, key=lambda t: t.arrival)
    if any(len(r) != len(ordered) for r in replays):
        raise ValueError(f"every replay needs {len(ordered)} requests, as the simulator ran")
    rows = []
    for i, t in enumerate(ordered):
        real = tuple((r[i].ttft, r[i].itl) for r in replays)
        rows.append(TraceRow(t.arrival, t.ttft, t.itl, real))
    return rows


def over(rows: Sequence[TraceRow], replay: int, factor: float = OVER) -> int:
    """Requests of replay ``replay`` whose ITL exceeds ``factor`` x the simulator's."""
    return sum(
        1
        for r in rows
        if r.sim_itl is not None
        and r.real[replay][1] is not None
        and r.real[replay][1] > factor * r.sim_itl
    )


def _ms(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v * 1e3:{width}.{digits}f}"


def render(rows: Sequence[TraceRow], paces: Sequence[float]) -> str:
    """The request table (milliseconds), then per replay its p90s, pace and requests over."""
    replays = " | ".join(f"replay {i + 1} TTFT  ITL" for i in range(len(paces)))
    lines = [f"arrival s | sim TTFT  ITL | {replays}"]
    for r in rows:
        cells = " | ".join(f"{_ms(t, 13, 1)} {_ms(i, 5, 2)}" for t, i in r.real)
        lines.append(f"{r.arrival:9.3f} | {_ms(r.sim_ttft, 8, 1)} {_ms(r.sim_itl, 5, 2)} | {cells}")

    def p90(values: list[float | None]) -> str:
        vals = [v for v in values if v is not None]
        return _ms(_p90(vals), 0, 2) if vals else "-"

    lines.append(f"simulator: TTFT p90 {p90([r.sim_ttft for r in rows])} ms, ITL p90 "
                 f"{p90([r.sim_itl for r in rows])} ms")  # fmt: skip
    for k, pace in enumerate(paces):
        lines.append(
            f"replay {k + 1}: TTFT p90 {p90([r.real[k][0] for r in rows])} ms, ITL p90 "
            f"{p90([r.real[k][1] for r in rows])} ms, steps at {pace:.2f}x the simulator's, "
            f"{over(rows, k)} of {len(rows)} requests over {OVER:.2f}x its ITL"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Case:
    """One validation case from the command line: what ``plan_trace`` and ``plan_cpu`` replay
    and simulate."""

    name: str  # "demo decode-heavy 12.820/s 1P1D, 385 requests (32 in, 128 out)"
    model: str
    profile_path: Path
    threads: int
    workload: Workload
    requests: list[WorkloadRequest]
    warm: list[WorkloadRequest]
    prefill: int
    decode: int
    cores: int


def case_parser(description: str) -> argparse.ArgumentParser:
    """The case's options (model, profile, workload, load or rate, deployment, duration)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True, help="demo, random-512 or a model directory")
    ap.add_argument("--profile", required=True, help="the profile to predict from")
    ap.add_argument("--workload", choices=["chat", "prefill-heavy", "decode-heavy"],
                    required=True)  # fmt: skip
    ap.add_argument("--load", choices=["light", "moderate"], default="light")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: --load's)")
    ap.add_argument("--deployment", choices=sorted(DEPLOYMENTS), default="colocated")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    ap.add_argument("--cores", type=int, default=available_cpus(),
                    help="cores the workers share (the simulator's shared_cores)")  # fmt: skip
    return ap


def case_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Case:
    """The case ``case_parser``'s options name (its rate from the profile unless given)."""
    if args.duration <= 0 or (args.rate is not None and args.rate <= 0):
        ap.error("--duration and --rate must be positive")
    profile_path = Path(args.profile)
    profile = load_profile(profile_path)
    isl, osl = workloads(profile.model.max_model_len)[args.workload]
    rate = args.rate or rates(profile, isl, osl)[args.load]
    w = case_workload(rate, isl, osl, max(20, round(rate * args.duration)))
    reqs, warm = case_requests(w, profile)
    p, d = DEPLOYMENTS[args.deployment]
    name = (f"{args.model} {args.workload} {rate:.3f}/s {args.deployment}, {len(reqs)} requests "
            f"({isl} in, {osl} out)")  # fmt: skip
    return Case(name, model_path(args.model), profile_path, profile.threads, w, reqs, warm, p, d,
                args.cores)  # fmt: skip


def main() -> None:
    ap = case_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="replays, each on a fresh deployment")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be positive")
    c = case_from_args(ap, args)
    sim = _simulate(c.profile_path, c.workload, c.prefill, c.decode, c.cores, simulated=False)
    replays, paces = [], []
    logs = Path(tempfile.mkdtemp(prefix="plan-trace-"))
    for k in range(args.repeats):
        (logs / str(k)).mkdir()
        args_up = up_args(c.model, c.prefill, c.decode, c.threads)
        with LocalUp(args_up, c.prefill + c.decode, logs / str(k)) as up:
            replay(up.url, c.model, c.warm)
            busy = _busy(up)
            replays.append(replay(up.url, c.model, c.requests))
            paces.append((_busy(up) - busy) / engine_seconds(sim))
    print(f"{c.name}, logs in {logs}")
    print(render(join(sim.traces, replays), paces))


if __name__ == "__main__":
    main()
