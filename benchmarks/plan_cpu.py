"""One validation case's CPU by process: the real `tandem up` beside the simulator's charges.

``plan_validation.py`` prints each case's CPU per request summed over every process. When a
case's latency is under-predicted, the question is which thread the simulator under-charges:
a router or client loop that is busier than simulated queues every token behind it. This
replays one case (the same generator and seed as ``plan_validation.py``) on a fresh `tandem
up`, and prints per process (router, each worker role, this process as the client) its CPU per
request, measured and simulated, and, measured, how long its threads waited on the run queue
(``/proc/PID/task/TID/schedstat``: a woken thread waiting for a core) per request and per
time slice.

    python benchmarks/plan_cpu.py --model demo --profile /tmp/pv/profile-demo.json \\
        --workload decode-heavy --load moderate --deployment 1P1D --duration 30

Round 41 of docs/planning.md used it on the demo's decode-heavy moderate 1P1D case.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from plan_trace import case_from_args, case_parser
from plan_validation import simulation, up_args
from replay_load import replay

from tandem.calibrate import CLIENT, LocalUp, children_cpu, tandem_children
from tandem.planner.simulator import Simulation


@dataclass(frozen=True, slots=True)
class SchedStat:
    """A thread's (or a sum of threads') ``schedstat``: seconds on a CPU, seconds waiting on
    the run queue, and time slices run."""

    run: float = 0.0
    wait: float = 0.0
    slices: int = 0

    def __add__(self, other: SchedStat) -> SchedStat:
        return SchedStat(self.run + other.run, self.wait + other.wait, self.slices + other.slices)

    def __sub__(self, other: SchedStat) -> SchedStat:
        return SchedStat(self.run - other.run, self.wait - other.wait, self.slices - other.slices)


def parse_schedstat(text: str) -> SchedStat:
    """``/proc/.../schedstat``: nanoseconds run, nanoseconds waited, slices."""
    run, wait, slices = text.split()
    return SchedStat(int(run) / 1e9, int(wait) / 1e9, int(slices))


def _threads(proc: Path) -> SchedStat:
    total = SchedStat()
    for task in (proc / "task").iterdir():
        try:
            total += parse_schedstat((task / "schedstat").read_text())
        except (OSError, ValueError):
            continue  # ended meanwhile
    return total


def role_schedstats(parent: int) -> dict[str, SchedStat]:
    """The live threads' ``schedstat`` of each child of ``parent`` (a `tandem up`), summed by
    its `tandem` subcommand, and this process's under ``CLIENT``."""
    out = {CLIENT: _threads(Path(f"/proc/{os.getpid()}"))}
    for name, entry in tandem_children(parent):
        try:
            out[name] = out.get(name, SchedStat()) + _threads(entry)
        except OSError:
            continue  # gone meanwhile
    return out


def simulated_cpu(sim: Simulation) -> dict[str, float]:
    """CPU seconds the simulator charged, by process: the router's loops, the client's, and
    each worker role's (steps at the profile's pace, and the serving work charged to it)."""
    out = {"router": sum(loop.busy_seconds for loop in sim.router.loops)}
    if sim.router.client is not None:
        out[CLIENT] = sim.router.client.busy_seconds
    for w in sim.workers:
        out[w.role.label] = out.get(w.role.label, 0.0) + w.busy_seconds
    return out


@dataclass(frozen=True, slots=True)
class CpuRow:
    """One process's CPU per request (seconds): measured, simulated, and its measured
    run-queue wait per request and per slice."""

    process: str
    measured: float
    simulated: float
    wait: float
    wait_per_slice: float


def compare(measured: Mapping[str, float], sched: Mapping[str, SchedStat],
            simulated: Mapping[str, float], requests: int) -> list[CpuRow]:  # fmt: skip
    """Per process (every one measured or simulated, sorted), its figures per request."""
    rows = []
    for name in sorted(set(measured) | set(simulated)):
        s = sched.get(name, SchedStat())
        rows.append(CpuRow(name, measured.get(name, 0.0) / requests,
                           simulated.get(name, 0.0) / requests, s.wait / requests,
                           s.wait / s.slices if s.slices > 0 else 0.0))  # fmt: skip
    return rows


def render(rows: list[CpuRow]) -> str:
    """The table, milliseconds; the ratio is measured over simulated."""
    lines = ["process    | CPU ms/request measured | simulated | ratio | run-queue wait ms/request"
             " | wait ms/slice"]  # fmt: skip
    for r in rows:
        ratio = f"{r.measured / r.simulated:5.2f}" if r.simulated > 0 else "    -"
        lines.append(
            f"{r.process:<10} | {r.measured * 1e3:23.1f} | {r.simulated * 1e3:9.1f} | {ratio} | "
            f"{r.wait * 1e3:25.1f} | {r.wait_per_slice * 1e3:13.3f}"
        )
    m = sum(r.measured for r in rows)
    s = sum(r.simulated for r in rows)
    lines.append(f"{'all':<10} | {m * 1e3:23.1f} | {s * 1e3:9.1f} | "
                 f"{m / s if s > 0 else float('nan'):5.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = case_parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    c = case_from_args(ap, args)
    logs = Path(tempfile.mkdtemp(prefix="plan-cpu-"))
    with LocalUp(up_args(c.model, c.prefill, c.decode, c.threads), c.prefill + c.decode,
                 logs) as up:  # fmt: skip
        replay(up.url, c.model, c.warm)
        cpu0, sched0 = children_cpu(up.proc.pid), role_schedstats(up.proc.pid)
        own = time.process_time()
        replay(up.url, c.model, c.requests)
        own = time.process_time() - own
        cpu1, sched1 = children_cpu(up.proc.pid), role_schedstats(up.proc.pid)
    measured = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1} | {CLIENT: own}
    sched = {k: v - sched0.get(k, SchedStat()) for k, v in sched1.items()}
    sim = simulation(c.profile_path, c.workload, c.prefill, c.decode, c.cores, simulated=False)
    print(f"{c.name}, logs in {logs}")
    print(render(compare(measured, sched, simulated_cpu(sim), len(c.requests))))


if __name__ == "__main__":
    main()
