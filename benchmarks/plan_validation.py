"""Validate the planner's simulator against real `tandem up` runs, in one command.

For each model: `tandem profile` (or ``--profile``), then for 3 workloads x 2 loads x
{colocated, 1P1D}: run the real deployment (`tandem up`, KV over TCP) under a replay of the
workload (``replay_load.py``: the simulator's own requests, at their arrival times), simulate the
same requests with `tandem.planner` (the workers sharing this machine's cores, the client
included), and compare TTFT p90 and ITL p90 (client view, guidellm's definitions). Each case runs
``--repeats`` times, the rounds interleaved, and is judged against the median of its rounds.
By default every round after the first is preceded by a fresh profile, and each round is
predicted from the profile made just before it (``--one-profile``: every round from the
first): this machine's pace moves by tens of percent over minutes, and one profile carries the
pace of the minutes it was made in. The table reports the single-profile figures too.
Writes ``results.json``, a Markdown table and the predicted-vs-measured plot to ``--out``.

    python benchmarks/plan_validation.py --models demo --duration 20   # ~20 min (3 rounds)
    python benchmarks/plan_validation.py                       # demo + random-512, ~2 h
    python benchmarks/plan_validation.py --models demo --quick # a smoke run, ~5 min
    python benchmarks/plan_validation.py --simulated-workers   # the simulator against
        # `tandem up --simulate` on the same profile: the router, HTTP and scheduling model alone

Run it on a quiet machine: every number is a wall-clock latency. ``plan_resimulate.py`` predicts
a saved run (its ``--out``) again with the current simulator.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from replay_load import Measured, replay

from tandem.calibrate import LocalUp, children_cpu
from tandem.engine.cpu_threads import available_cpus, split_threads
from tandem.engine.sim.profile import Profile, load_profile
from tandem.planner.metrics import Percentiles
from tandem.planner.simulator import Deployment, SimOptions, simulate
from tandem.planner.workload import Arrival, Lengths, Workload, generate

DEPLOYMENTS = {"colocated": (0, 1), "1P1D": (1, 1)}


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    workload: str
    load: str
    rate: float
    deployment: str
    requests: int
    measured_ttft_p90: float
    predicted_ttft_p90: float
    measured_itl_p90: float
    predicted_itl_p90: float
    failed: int
    # Each round's measured p90s (the measured figures above are their medians).
    ttft_rounds: tuple[float, ...] = ()
    itl_rounds: tuple[float, ...] = ()
    # Each round's prediction, from the profile made before it (one profile: all the same; the
    # predicted figures above are their medians).
    predicted_ttft_rounds: tuple[float, ...] = ()
    predicted_itl_rounds: tuple[float, ...] = ()
    # Each round's CPU seconds per request, every `tandem up` process and the client together,
    # over the timed replay: the same requests each round, so its spread is the machine's pace
    # between rounds (a run saved before it was recorded has none).
    cpu_rounds: tuple[float, ...] = ()

    @property
    def ttft_error(self) -> float:
        return self.predicted_ttft_p90 / self.measured_ttft_p90 - 1

    @property
    def itl_error(self) -> float:
        return self.predicted_itl_p90 / self.measured_itl_p90 - 1

    @property
    def rounds_within(self) -> int:
        """Rounds whose own measured p90s are both within 25 % of that round's prediction."""
        pt = self.predicted_ttft_rounds or (self.predicted_ttft_p90,) * len(self.ttft_rounds)
        pi = self.predicted_itl_rounds or (self.predicted_itl_p90,) * len(self.itl_rounds)
        return sum(
            abs(t / mt - 1) <= 0.25 and abs(i / mi - 1) <= 0.25
            for mt, mi, t, i in zip(self.ttft_rounds, self.itl_rounds, pt, pi, strict=True)
        )

    def first_profile(self) -> Row:
        """This row judged on the first round's profile alone (the single-profile figures)."""
        if not self.predicted_ttft_rounds:
            return self
        t, i = self.predicted_ttft_rounds[0], self.predicted_itl_rounds[0]
        n = len(self.ttft_rounds)
        return replace(self, predicted_ttft_p90=t, predicted_itl_p90=i,
                       predicted_ttft_rounds=(t,) * n, predicted_itl_rounds=(i,) * n)  # fmt: skip


def workloads(max_model_len: int) -> dict[str, tuple[int, int]]:
    """(input, output) tokens of the three shapes, scaled to the model's context (at most 512,
    so a run stays about a minute)."""
    max_len = min(max_model_len, 512)
    return {
        "chat": (max_len // 4, max_len // 8),
        "prefill-heavy": (max_len * 3 // 4, max_len // 16),
        "decode-heavy": (max_len // 8, max_len // 2),
    }


def rates(profile: Profile, isl: int, osl: int) -> dict[str, float]:
    """Light and moderate loads: 30% and 60% of what one worker serves one request at a time,
    the whole path included (the simulator's end-to-end latency of a lone request: router,
    prefill, every decode step and the streaming of each token). Counting the engine's steps
    alone would put "moderate" past what the router and the worker shell can stream on a
    machine where a step costs less than the Python around it (the demo model on a CPU)."""
    lone = Workload(rate=1.0, isl=Lengths(isl), osl=Lengths(osl), num_requests=1)
    alone = simulate(
        profile, lone, Deployment(prefill=0, decode=1), SimOptions(seed=0, variability=False)
    ).e2e.p50
    return {"light": round(0.3 / alone, 3), "moderate": round(0.6 / alone, 3)}


def case_workload(rate: float, isl: int, osl: int, requests: int) -> Workload:
    """A case's workload: Poisson arrivals of fixed-length requests (the replay and the
    simulator both draw its requests with seed 0; ``plan_resimulate.py`` rebuilds it)."""
    return Workload(rate=rate, isl=Lengths(isl), osl=Lengths(osl), num_requests=requests,
                    arrival=Arrival.POISSON)  # fmt: skip


def profile_model(model: str, name: str, out: Path, quick: bool, threads: int,
                  suffix: str = "") -> Path:  # fmt: skip
    """Profile ``model`` into ``out``/profile-``name````suffix``.json (``name``: the model's name
    in the tables, which ``plan_resimulate.py`` finds the profiles by)."""
    path = out / f"profile-{name}{suffix}.json"
    cmd = [sys.executable, "-m", "tandem.cli", "profile", "--model", model, "--output", str(path),
           "--transports", "tcp", "--threads", str(threads)]  # fmt: skip
    cmd += ["--quick"] if quick else []
    subprocess.run(cmd, check=True)
    return path


def _p90(values: list[float]) -> float:
    return Percentiles.of(values).p90


def _predict(profile_path: Path, w: Workload, p: int, d: int, cores: int | None,
             simulated: bool) -> tuple[float, float]:  # fmt: skip
    """The simulator's client-view (TTFT p90, ITL p90) for ``w`` on ``p``P``d``D."""
    dep = Deployment(prefill=p, decode=d, kv_transport="tcp")
    # Simulated workers wait their steps: they share no cores in the simulator. The replay
    # client runs on the same cores as the workers.
    shared = None if simulated else cores
    options = SimOptions(seed=0, shared_cores=shared, variability=not simulated,
                         client_shares_cores=True)  # fmt: skip
    sim = simulate(load_profile(profile_path), w, dep, options)
    return sim.ttft.p90, sim.itl.p90


def run_model(model: str, name: str, profile_path: Path, out: Path, duration: float,
              quick: bool, cores: int | None, simulated: bool, repeats: int = 1,
              reprofile: Callable[[int], Path] | None = None) -> list[Row]:  # fmt: skip
    """Every case's real run of ``model`` (``name`` in the table) ``repeats`` times, the rounds
    interleaved (all cases, then all again): this machine's speed drifts by tens of percent
    over minutes, so a case measured in one stretch would carry that stretch's pace. Each
    case's measured p90 is the median of its rounds. The cases (rates, requests) come from the
    first profile; with ``reprofile`` every later round is predicted from the profile
    ``reprofile(round)`` makes just before it, else from the first. The prediction is the
    median of the rounds' (the simulator is deterministic for its seed and profile)."""
    profile = load_profile(profile_path)
    threads = profile.threads
    shapes = workloads(profile.model.max_model_len)
    if quick:
        shapes = dict(list(shapes.items())[:1])
    cases = []
    for wname, (isl, osl) in shapes.items():
        loads = rates(profile, isl, osl)
        if quick:
            loads = {"moderate": loads["moderate"]}
        for lname, rate in loads.items():
            n = max(20, round(rate * duration))
            w = case_workload(rate, isl, osl, n)
            for dname, (p, d) in DEPLOYMENTS.items():
                cases.append((wname, lname, rate, dname, p, d, w))
    measured: dict[int, list[tuple[float, float, int, float]]] = {i: [] for i in range(len(cases))}
    predicted: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(cases))}
    round_profile = profile_path
    for rnd in range(repeats):
        if rnd and reprofile is not None:
            round_profile = reprofile(rnd)
        for i, (wname, lname, rate, dname, p, d, w) in enumerate(cases):
            reqs = generate(w, profile.model.sim_token_ids, 0, profile.model.max_model_len)
            warm = generate(replace(w, num_requests=4), profile.model.sim_token_ids, 99,
                            profile.model.max_model_len)  # fmt: skip
            logs = out / "logs" / f"{name}-{wname}-{lname}-{dname}-{rnd}"
            logs.mkdir(parents=True, exist_ok=True)
            # Every deployment's workers run the threads the profile's steps were timed with.
            args = ["--model", model, "--prefill", str(p), "--decode", str(d),
                    "--kv-transport", "tcp", "--worker-threads", str(threads)]  # fmt: skip
            if simulated:
                args += ["--simulate", str(round_profile)]
            with LocalUp(args, p + d, logs) as up:
                replay(up.url, model, warm)  # tandem up serves --model under that name
                before, own = children_cpu(up.proc.pid), time.process_time()
                got: list[Measured] = replay(up.url, model, reqs)
                after, own = children_cpu(up.proc.pid), time.process_time() - own
            ok = [m for m in got if m.error is None]
            ttft = _p90([m.ttft for m in ok if m.ttft is not None])
            itl = _p90([m.itl for m in ok if m.itl is not None])
            cpu = (sum(after.values()) - sum(before.values()) + own) / len(reqs)
            measured[i].append((ttft, itl, len(got) - len(ok), cpu))
            predicted[i].append(_predict(round_profile, w, p, d, cores, simulated))
            pt, pi = predicted[i][-1]
            print(f"round {rnd + 1}/{repeats} {wname:>13} {lname:>8} {rate:7.3f}/s {dname:>9}: "
                  f"TTFT p90 {ttft:.3f} s (predicted {pt:.3f}), ITL p90 {itl * 1e3:.2f} ms "
                  f"(predicted {pi * 1e3:.2f}), CPU {cpu * 1e3:.1f} ms/request",
                  flush=True)  # fmt: skip
    rows = []
    for i, (wname, lname, rate, dname, _p, _d, w) in enumerate(cases):
        ttfts = tuple(m[0] for m in measured[i])
        itls = tuple(m[1] for m in measured[i])
        p_ttfts = tuple(m[0] for m in predicted[i])
        p_itls = tuple(m[1] for m in predicted[i])
        row = Row(
            model=name, workload=wname, load=lname, rate=rate, deployment=dname,
            requests=w.num_requests, measured_ttft_p90=statistics.median(ttfts),
            predicted_ttft_p90=statistics.median(p_ttfts), measured_itl_p90=statistics.median(itls),
            predicted_itl_p90=statistics.median(p_itls), failed=sum(m[2] for m in measured[i]),
            ttft_rounds=ttfts, itl_rounds=itls, predicted_ttft_rounds=p_ttfts,
            predicted_itl_rounds=p_itls, cpu_rounds=tuple(m[3] for m in measured[i]),
        )  # fmt: skip
        rows.append(row)
        print(f"{row.model:>10} {wname:>13} {lname:>8} {rate:7.3f}/s {dname:>9}: "
              f"TTFT p90 {row.measured_ttft_p90:.3f} s vs {row.predicted_ttft_p90:.3f} "
              f"({row.ttft_error:+.0%}), ITL p90 {row.measured_itl_p90:.4f} s vs "
              f"{row.predicted_itl_p90:.4f} ({row.itl_error:+.0%})", flush=True)  # fmt: skip
    return rows


def _span(values: tuple[float, ...], scale: float, unit: str, digits: int) -> str:
    if len(values) < 2:
        return ""
    return f" ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f} {unit})"


def _within(rows: list[Row]) -> tuple[int, int, int]:
    """(cases whose median errors are both within 25 %, single runs within against their own
    round's prediction, single runs)."""
    cases = sum(abs(r.ttft_error) <= 0.25 and abs(r.itl_error) <= 0.25 for r in rows)
    return cases, sum(r.rounds_within for r in rows), sum(len(r.ttft_rounds) for r in rows)


def table(rows: list[Row]) -> str:
    cpu = any(r.cpu_rounds for r in rows)
    lines = [
        "| model | workload | load | rate (req/s) | deployment | TTFT p90 measured (rounds) /"
        " predicted (rounds) (error) | ITL p90 measured (rounds) / predicted (rounds) (error) |"
        + (" CPU per request (rounds) |" if cpu else ""),
        "| --- | --- | --- | ---: | --- | --- | --- |" + (" --- |" if cpu else ""),
    ]
    for r in rows:
        spent = " |" if cpu else ""  # a run saved before CPU was recorded: an empty cell
        if r.cpu_rounds:
            mid = statistics.median(r.cpu_rounds) * 1e3
            spent = f" {mid:.1f} ms{_span(r.cpu_rounds, 1e3, 'ms', 1)} |"
        lines.append(
            f"| {r.model} | {r.workload} | {r.load} | {r.rate:g} | {r.deployment} | "
            f"{r.measured_ttft_p90:.3f} s{_span(r.ttft_rounds, 1, 's', 3)} / "
            f"{r.predicted_ttft_p90:.3f} s{_span(r.predicted_ttft_rounds, 1, 's', 3)} "
            f"({r.ttft_error:+.0%}) | "
            f"{r.measured_itl_p90 * 1e3:.2f} ms{_span(r.itl_rounds, 1e3, 'ms', 2)} / "
            f"{r.predicted_itl_p90 * 1e3:.2f} ms{_span(r.predicted_itl_rounds, 1e3, 'ms', 2)} "
            f"({r.itl_error:+.0%}) |{spent}"
        )
    within, single, runs = _within(rows)
    lines.append(
        f"\n{within} of {len(rows)} cases have both errors within 25 % against the median of "
        f"their rounds; {single} of {runs} single runs do (each against its own round's "
        f"prediction)."
    )
    if any(len(set(r.predicted_ttft_rounds)) > 1 for r in rows):
        within, single, runs = _within([r.first_profile() for r in rows])
        lines.append(
            f"With the first round's profile alone: {within} of {len(rows)} cases; {single} of "
            f"{runs} single runs."
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, metric, unit in ((axes[0], "ttft", "s"), (axes[1], "itl", "s")):
        xs = [getattr(r, f"measured_{metric}_p90") for r in rows]
        ys = [getattr(r, f"predicted_{metric}_p90") for r in rows]
        for dep, marker in (("colocated", "o"), ("1P1D", "s")):
            pts = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r.deployment == dep]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=dep)
        lo, hi = min(xs + ys) * 0.7, max(xs + ys) * 1.4
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], alpha=0.15,
                        color="gray", label="±25 %")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {metric.upper()} p90 ({unit})")
        ax.set_ylabel(f"predicted {metric.upper()} p90 ({unit})")
        ax.legend()
    fig.suptitle("tandem plan's simulator vs real tandem up (same requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,random-512",
                    help="comma-separated: demo, random-512 (a random-weight Llama, hidden 512, "
                    "whose tokens are printable characters) "
                    "or model directories")  # fmt: skip
    ap.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="MODEL=PROFILE.json",
        help="reuse a profile instead of profiling (repeatable)",
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per run")
    ap.add_argument("--repeats", type=int, default=3,
                    help="real runs per case, interleaved; each case's measured p90 is their "
                    "median")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="one workload, one load, quick profile")
    ap.add_argument("--one-profile", action="store_true",
                    help="predict every round from the first profile (default: profile again "
                    "before each later round and predict it from that profile)")  # fmt: skip
    ap.add_argument(
        "--cores",
        type=int,
        default=available_cpus(),
        help="cores the workers share (the simulator's shared_cores)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="each worker's engine threads, profiled and served alike (default: what `tandem "
        "up` gives each of two workers on --cores: one core left for the router and client)",
    )
    ap.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    ap.add_argument(
        "--simulated-workers",
        action="store_true",
        help="run `tandem up --simulate` on each profile instead of the real model",
    )
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="plan-validation-"))
    out.mkdir(parents=True, exist_ok=True)
    given = dict(p.split("=", 1) for p in args.profile)
    rows: list[Row] = []
    for name in args.models.split(","):
        model = name
        label = Path(name).name  # the tables' and profiles' name: random-512, not its temp dir
        if name == "random-512":
            from offline_throughput import write_random_llama

            model = write_random_llama(hidden=512, layers=4, printable=True)
        threads = args.threads or split_threads(args.cores, 2)
        if name in given:
            # A copy beside the results, so plan_resimulate.py finds it there as it finds a
            # profile made by the run.
            profile = out / f"profile-{label}.json"
            if Path(given[name]).resolve() != profile.resolve():
                shutil.copyfile(given[name], profile)
        else:
            profile = profile_model(model, label, out, args.quick, threads)

        def reprofile(rnd: int, model: str = model, label: str = label,
                      threads: int = threads) -> Path:  # fmt: skip
            return profile_model(model, label, out, args.quick, threads, f"-round{rnd + 1}")

        again = None if args.one_profile or name in given else reprofile
        rows += run_model(model, label, profile, out, args.duration, args.quick, args.cores,
                          args.simulated_workers, args.repeats, again)  # fmt: skip
        # After each model, so a later model's failure keeps the earlier figures.
        (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "table.md").write_text(table(rows) + "\n")
    plot(rows, out / "plan_validation.png")
    print(table(rows))
    print(f"\nwrote {out}/results.json, table.md and plan_validation.png")


if __name__ == "__main__":
    main()
