"""A prefill's first token in 1P1D, alone and beside another request's decode, with the
processes left to the kernel's scheduler and then pinned apart.

The simulator shares a host's cores between threads as processor sharing (``planner/cores.py``:
n threads wanting c cores each run at min(1, c / n)). On two cores a prefill step beside a
decode step should then run at full speed. This measures whether it does: on a fresh `tandem
up` of one prefill and one decode worker, ``--requests`` lone prompts of ``--prompt`` tokens
(one token each), then as many again each sent ``--delay`` seconds after a short request that
decodes ``--decode-tokens`` tokens, so that it prefills while the other decodes. Four phases:
unpinned; the prefill worker alone on the first CPU and every other process (decode worker,
router, this client) on the rest (``taskset``); the two workers apart, the router and this
client free on every CPU; unpinned again (the host's pace may move between phases). Where
pinning removes the gap, the gap is the scheduler's placement of threads, not the hardware
(docs/planning.md, round 48).

    python benchmarks/plan_contention.py --model random-512
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from plan_validation import model_path

from tandem.calibrate import LocalUp, tandem_children
from tandem.stream_client import stream_times

# Printable characters: tokens that random-512 (and the demo's byte vocabulary) both have.
TOKENS = (*range(48, 58), *range(65, 91), *range(97, 123))
SHORT_PROMPT = 32  # the decoding request's prompt
WARMUP = 6


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase's first-token latencies (seconds): lone prompts, and prompts sent beside a
    decode."""

    name: str
    alone: tuple[float, ...]
    beside: tuple[float, ...]


def p90(values: Sequence[float]) -> float:
    """The nearest-rank 90th percentile."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, -(-9 * len(v) // 10) - 1))]


def pin_plan(children: Sequence[tuple[str, int]], cpus: Sequence[int],
             workers_only: bool = False) -> dict[int, str]:  # fmt: skip
    """``taskset`` CPU lists per pid: the prefill worker on the first of ``cpus``, every other
    child on the rest (``workers_only``: the decode worker on the rest, the router left on all
    of them). ValueError with fewer than two CPUs or without exactly one prefill worker."""
    if len(cpus) < 2:
        raise ValueError("pinning apart needs at least two CPUs")
    if sum(name == "prefill" for name, _ in children) != 1:
        raise ValueError("pinning apart needs exactly one prefill worker")
    first, rest = str(cpus[0]), ",".join(str(c) for c in cpus[1:])
    every = ",".join(str(c) for c in cpus)
    plan = {}
    for name, pid in children:
        if name == "prefill":
            plan[pid] = first
        else:
            plan[pid] = every if workers_only and name != "decode" else rest
    return plan


def render(phases: Sequence[Phase]) -> str:
    """A markdown table: per phase, each set's median and p90 in ms and the gap of medians."""
    lines = [
        "| phase | alone: median / p90 | beside a decode: median / p90 | gap of medians |",
        "| --- | ---: | ---: | ---: |",
    ]
    for p in phases:
        a, b = statistics.median(p.alone), statistics.median(p.beside)
        lines.append(
            f"| {p.name} | {a * 1e3:.1f} / {p90(p.alone) * 1e3:.1f} ms "
            f"| {b * 1e3:.1f} / {p90(p.beside) * 1e3:.1f} ms | {(b - a) * 1e3:+.1f} ms |"
        )
    return "\n".join(lines)


def _taskset(pid: int, cpus: str) -> None:
    # -a: every thread of the process, the engine's and the HTTP side's.
    subprocess.run(["taskset", "-a", "-pc", cpus, str(pid)], check=True, capture_output=True)


async def _measure(up: LocalUp, model: str, args: argparse.Namespace, rng: random.Random,
                   name: str) -> Phase:  # fmt: skip
    def prompt(n: int) -> list[int]:
        return rng.choices(TOKENS, k=n)

    async def first(client: httpx.AsyncClient, p: list[int], k: int, delay: float) -> float:
        await asyncio.sleep(delay)
        times = await stream_times(client, up.url, model, p, k)
        if not times:
            raise RuntimeError("a request did not stream all its tokens")
        return times[0]

    alone, beside = [], []
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(WARMUP):
            await first(client, prompt(SHORT_PROMPT), 4, 0.0)
        for _ in range(args.requests):
            alone.append(await first(client, prompt(args.prompt), 1, 0.0))
            await asyncio.sleep(args.gap)
        for _ in range(args.requests):
            _, t = await asyncio.gather(
                first(client, prompt(SHORT_PROMPT), args.decode_tokens, 0.0),
                first(client, prompt(args.prompt), 1, args.delay),
            )
            beside.append(t)
            await asyncio.sleep(args.gap)
    return Phase(name, tuple(alone), tuple(beside))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random-512", help="a model path, or random-512")
    ap.add_argument("--prompt", type=int, default=128, help="the timed prompt's tokens")
    ap.add_argument("--decode-tokens", type=int, default=64, help="the other request's tokens")
    ap.add_argument("--requests", type=int, default=15, help="timed prompts per set")
    ap.add_argument("--delay", type=float, default=0.1, help="seconds after the decoding one")
    ap.add_argument("--gap", type=float, default=0.3, help="idle seconds between samples")
    args = ap.parse_args()
    if min(args.prompt, args.decode_tokens, args.requests) < 1 or args.delay < 0 or args.gap < 0:
        ap.error("--prompt, --decode-tokens and --requests must be positive, the times >= 0")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        ap.error("pinning apart needs at least two CPUs")
    model = model_path(args.model)
    up_args = ["--model", model, "--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
               "--worker-threads", "1"]  # fmt: skip
    rng = random.Random(0)
    with LocalUp(up_args, 2, Path(tempfile.mkdtemp(prefix="plan-contention-"))) as up:
        children = [(name, int(entry.name)) for name, entry in tandem_children(up.proc.pid)]
        plan = pin_plan(children, cpus)
        phases = [asyncio.run(_measure(up, model, args, rng, "unpinned"))]
        for pid, where in plan.items():
            _taskset(pid, where)
        os.sched_setaffinity(0, cpus[1:])
        try:
            phases.append(asyncio.run(_measure(up, model, args, rng, "prefill pinned apart")))
            os.sched_setaffinity(0, cpus)
            for pid, where in pin_plan(children, cpus, workers_only=True).items():
                _taskset(pid, where)
            phases.append(asyncio.run(_measure(up, model, args, rng, "workers pinned apart")))
        finally:
            os.sched_setaffinity(0, cpus)
            for pid in plan:
                _taskset(pid, ",".join(map(str, cpus)))
        phases.append(asyncio.run(_measure(up, model, args, rng, "unpinned again")))
    print(f"{args.model}: a {args.prompt}-token prompt's first token, 1P1D on CPUs {cpus}")
    print(render(phases))


if __name__ == "__main__":
    main()
