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
pace of the minutes it was made in. The table reports the single-profile figures too, and a
diagnostic: how fast each case's engine steps ran against the simulator's seconds for them
(every worker's ``tandem_worker_busy_seconds_total``), and the case predicted again at that pace.
Writes ``results.json``, a Markdown table and the predicted-vs-measured plot to ``--out``.

    python benchmarks/plan_validation.py --models demo --duration 20   # ~25 min (3 rounds)
    python benchmarks/plan_validation.py                       # demo + random-512, ~2 h
    python benchmarks/plan_validation.py --models demo --quick # a smoke run, ~5 min
    python benchmarks/plan_validation.py --simulated-workers   # the simulator against
        # `tandem up --simulate` on the same profile: the router, HTTP and scheduling model alone

Run it on a quiet machine: every number is a wall-clock latency. Leave the checkout alone
meanwhile: each case starts processes from it, so the run stops before a case if the Tandem
source has changed since it began (``benchlib/source.py``). ``plan_resimulate.py`` predicts a
saved run (its ``--out``) again with the current simulator.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from math import nan
from pathlib import Path

from benchlib.metrics import histogram_quantile, scrape, total
from benchlib.source import SourceGuard
from plan_report import Row, plot, table
from replay_load import Measured, replay

from tandem.calibrate import CPU_REQUESTS, LocalUp, children_cpu, measure_serving, serving_cost
from tandem.child_command import tandem_argv
from tandem.engine.cpu_threads import available_cpus, split_threads
from tandem.engine.sim.profile import Profile, load_profile
from tandem.planner.metrics import Percentiles, SimResult
from tandem.planner.simulator import Deployment, SimOptions, Simulation, run_simulation, simulate
from tandem.planner.workload import Arrival, Lengths, Workload, WorkloadRequest, generate

DEPLOYMENTS = {"colocated": (0, 1), "1P1D": (1, 1)}
WORKER_TTFT = "tandem_worker_time_to_first_token_seconds"  # engine/worker/metrics.py
BUSY = "tandem_worker_busy_seconds_total"


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


def case_requests(w: Workload, profile: Profile) -> tuple[list[WorkloadRequest],
                                                          list[WorkloadRequest]]:  # fmt: skip
    """A case's requests (seed 0, the ones the simulator predicts) and the 4 that warm a fresh
    deployment up first (seed 99: no prefix shared with the timed ones)."""
    ids, max_len = profile.model.sim_token_ids, profile.model.max_model_len
    return generate(w, ids, 0, max_len), generate(replace(w, num_requests=4), ids, 99, max_len)


def model_path(name: str) -> str:
    """``name`` as `tandem up --model` takes it: random-512 written to a temp dir (a
    random-weight Llama, hidden 512, whose tokens are printable characters), else as given."""
    if name != "random-512":
        return name
    from offline_throughput import write_random_llama

    return write_random_llama(hidden=512, layers=4, printable=True)


def profile_model(model: str, name: str, out: Path, quick: bool, threads: int,
                  suffix: str = "") -> Path:  # fmt: skip
    """Profile ``model`` into ``out``/profile-``name````suffix``.json (``name``: the model's name
    in the tables, which ``plan_resimulate.py`` finds the profiles by)."""
    path = out / f"profile-{name}{suffix}.json"
    cmd = [*tandem_argv("profile"), "--model", model, "--output", str(path),
           "--transports", "tcp", "--threads", str(threads)]  # fmt: skip
    cmd += ["--quick"] if quick else []
    subprocess.run(cmd, check=True)
    return path


# Per phase: one segment of `tandem profile`'s serving stage (its default three passes).
CASE_SERVING_REQUESTS = -(-CPU_REQUESTS // 3)


def recalibrate_serving(profile_path: Path, model: str, out: Path, threads: int,
                        seed: int) -> Path:  # fmt: skip
    """``profile_path``'s profile with its serving costs measured again now (one segment of
    the serving stage, ``CASE_SERVING_REQUESTS`` requests per phase), written to ``out``. The
    step and transfer models stay the profile's. On this host the serving path's per-token
    CPU moved by up to 2x between profiles of the same code hours apart, more than the
    steps did: measured just before a case it is the case's pace, not the profile's."""
    profile = load_profile(profile_path)
    sample = measure_serving(model, "tcp", profile.model.sim_token_ids, (), threads,
                             CASE_SERVING_REQUESTS, seed)  # fmt: skip
    replace(profile, serving=serving_cost(profile, [sample], "tcp")).save(out)
    return out


def case_dir(out: Path, name: str, wname: str, lname: str, dname: str, rnd: int) -> Path:
    """A case's round's folder under ``out``: its processes' logs and, with
    ``--serving-per-case``, the profile it was predicted from (``profile.json``)."""
    return out / "logs" / f"{name}-{wname}-{lname}-{dname}-{rnd}"


def _p90(values: list[float]) -> float:
    return Percentiles.of(values).p90


def _simulate(profile_path: Path, w: Workload, p: int, d: int, cores: int | None,
              simulated: bool, pace: float = 1.0) -> SimResult:  # fmt: skip
    """The simulator's run of ``w`` on ``p``P``d``D (its client view: ``ttft``, ``itl``); with
    ``pace``, every step that many times the profile's (``paced_rounds``)."""
    return simulation(profile_path, w, p, d, cores, simulated, pace).result


def simulation(profile_path: Path, w: Workload, p: int, d: int, cores: int | None,
               simulated: bool, pace: float = 1.0) -> Simulation:  # fmt: skip
    """``_simulate``'s run with its workers and router (their CPU, ``plan_cpu.py``)."""
    profile = load_profile(profile_path)
    if pace != 1.0:
        profile = replace(profile, step=profile.step.scaled(pace))
    dep = Deployment(prefill=p, decode=d, kv_transport="tcp")
    # Simulated workers wait their steps: they share no cores in the simulator. The replay
    # client runs on the same cores as the workers.
    shared = None if simulated else cores
    options = SimOptions(seed=0, shared_cores=shared, variability=not simulated,
                         client_shares_cores=True)  # fmt: skip
    return run_simulation(profile, w, dep, options)


def engine_seconds(sim: SimResult) -> float:
    """The simulated workers' step seconds (every pool), what the real ones' busy counters
    (``BUSY``) measure."""
    return sum(pool.engine_seconds for pool in sim.pools.values())


def _busy(up: LocalUp) -> float:
    """Every worker's ``BUSY`` counter, summed."""
    return sum(total(scrape(f"{w['url']}/metrics"), BUSY) for w in up.workers())


def front_role(p: int) -> str:
    """The role of the worker whose first token the client sees: prefill with ``p`` prefill
    workers, else colocated (the ``SimResult.pools`` key and the worker's ``role`` label)."""
    return "prefill" if p else "colocated"


def up_args(model: str, p: int, d: int, threads: int, simulate: Path | None = None) -> list[str]:
    """`tandem up`'s flags for a case's deployment (``p`` 0: one colocated worker), KV over TCP.
    Every worker runs the threads the profile's steps were timed with; ``simulate``: simulated
    workers on that profile."""
    args = ["--model", model, "--prefill", str(p), "--decode", str(d),
            "--kv-transport", "tcp", "--worker-threads", str(threads)]  # fmt: skip
    return args + (["--simulate", str(simulate)] if simulate is not None else [])


def _front_metrics(up: LocalUp, p: int) -> str:
    """The metrics URL of the front worker (``front_role``)."""
    return _role_metrics(up, front_role(p))


def _role_metrics(up: LocalUp, role: str) -> str:
    """The metrics URL of the (first) worker of ``role``."""
    return next(w["url"] for w in up.workers() if w["role"] == role) + "/metrics"


def run_model(model: str, name: str, profile_path: Path, out: Path, duration: float,
              quick: bool, cores: int | None, simulated: bool, repeats: int = 1,
              reprofile: Callable[[int], Path] | None = None,
              guard: SourceGuard | None = None,
              serving_per_case: bool = False) -> list[Row]:  # fmt: skip
    """Every case's real run of ``model`` (``name`` in the table) ``repeats`` times, the rounds
    interleaved (all cases, then all again): this machine's speed drifts by tens of percent
    over minutes, so a case measured in one stretch would carry that stretch's pace. Each
    case's measured p90 is the median of its rounds. The cases (rates, requests) come from the
    first profile; with ``reprofile`` every later round is predicted from the profile
    ``reprofile(round)`` makes just before it, else from the first. The prediction is the
    median of the rounds' (the simulator is deterministic for its seed and profile). With
    ``serving_per_case`` each case is predicted from that profile with its serving costs
    measured again just before the case (``recalibrate_serving``)."""
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
    # Per case, each round's (TTFT, ITL, failed, CPU per request, front worker's TTFT, busy,
    # decode worker's TTFT or nan).
    measured: dict[int, list[tuple[float, float, int, float, float, float, float]]] = {
        i: [] for i in range(len(cases))
    }
    # ... and (TTFT, ITL, front worker's TTFT, step seconds, paced TTFT, paced ITL, decode
    # worker's TTFT or nan).
    predicted: dict[int, list[tuple[float, ...]]] = {i: [] for i in range(len(cases))}
    round_profile = profile_path
    for rnd in range(repeats):
        if rnd and reprofile is not None:
            round_profile = reprofile(rnd)
        for i, (wname, lname, rate, dname, p, d, w) in enumerate(cases):
            if guard is not None:
                guard.check(f"{name} {wname} {lname} {dname} (round {rnd + 1})")
            reqs, warm = case_requests(w, profile)
            logs = case_dir(out, name, wname, lname, dname, rnd)
            logs.mkdir(parents=True, exist_ok=True)
            case_profile = round_profile
            if serving_per_case and not simulated:
                case_profile = recalibrate_serving(round_profile, model, logs / "profile.json",
                                                   threads, seed=1000 * rnd + i)  # fmt: skip
            args = up_args(model, p, d, threads, round_profile if simulated else None)
            with LocalUp(args, p + d, logs) as up:
                replay(up.url, model, warm)  # tandem up serves --model under that name
                front = _front_metrics(up, p)
                back = _role_metrics(up, "decode") if p else None
                hist0, before, own = scrape(front), children_cpu(up.proc.pid), time.process_time()
                back0 = scrape(back) if back else {}
                busy = _busy(up)
                got: list[Measured] = replay(up.url, model, reqs)
                after, own = children_cpu(up.proc.pid), time.process_time() - own
                busy = _busy(up) - busy
                worker_ttft = histogram_quantile(0.9, hist0, scrape(front), WORKER_TTFT)
                back_ttft = (
                    histogram_quantile(0.9, back0, scrape(back), WORKER_TTFT) if back else nan
                )
            ok = [m for m in got if m.error is None]
            ttft = _p90([m.ttft for m in ok if m.ttft is not None])
            itl = _p90([m.itl for m in ok if m.itl is not None])
            cpu = (sum(after.values()) - sum(before.values()) + own) / len(reqs)
            measured[i].append((ttft, itl, len(got) - len(ok), cpu, worker_ttft, busy, back_ttft))
            sim = _simulate(case_profile, w, p, d, cores, simulated)
            front_pool = sim.pools[front_role(p)]
            # The diagnostic: the same prediction with the steps at the pace the workers ran.
            steps = engine_seconds(sim)
            pace = busy / steps
            paced = _simulate(case_profile, w, p, d, cores, simulated, pace)
            back_pool = sim.pools.get("decode") if p else None
            predicted[i].append((sim.ttft.p90, sim.itl.p90, front_pool.first_token.p90,
                                 steps, paced.ttft.p90, paced.itl.p90,
                                 back_pool.first_token.p90 if back_pool else nan))  # fmt: skip
            pt, pi = predicted[i][-1][:2]
            print(f"round {rnd + 1}/{repeats} {wname:>13} {lname:>8} {rate:7.3f}/s {dname:>9}: "
                  f"TTFT p90 {ttft:.3f} s (predicted {pt:.3f}), ITL p90 {itl * 1e3:.2f} ms "
                  f"(predicted {pi * 1e3:.2f}), CPU {cpu * 1e3:.1f} ms/request, steps at "
                  f"{pace:.2f}x the simulator's", flush=True)  # fmt: skip
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
            worker_ttft_rounds=tuple(m[4] for m in measured[i]),
            predicted_worker_ttft_rounds=tuple(m[2] for m in predicted[i]),
            busy_rounds=tuple(m[5] for m in measured[i]),
            predicted_busy_rounds=tuple(m[3] for m in predicted[i]),
            paced_ttft_rounds=tuple(m[4] for m in predicted[i]),
            paced_itl_rounds=tuple(m[5] for m in predicted[i]),
            decode_ttft_rounds=tuple(m[6] for m in measured[i]) if _p else (),
            predicted_decode_ttft_rounds=tuple(m[6] for m in predicted[i]) if _p else (),
        )  # fmt: skip
        rows.append(row)
        print(f"{row.model:>10} {wname:>13} {lname:>8} {rate:7.3f}/s {dname:>9}: "
              f"TTFT p90 {row.measured_ttft_p90:.3f} s vs {row.predicted_ttft_p90:.3f} "
              f"({row.ttft_error:+.0%}), ITL p90 {row.measured_itl_p90:.4f} s vs "
              f"{row.predicted_itl_p90:.4f} ({row.itl_error:+.0%})", flush=True)  # fmt: skip
    return rows


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
    ap.add_argument(
        "--serving-per-case",
        action="store_true",
        help="before each case, measure the serving costs again (one segment of "
        "the profile's serving stage, ~25 s for the demo, ~1.5 min for random-512) and "
        "predict the case from them",
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
    guard = SourceGuard()  # before the first profile: every process of the run runs this code
    rows: list[Row] = []
    for name in args.models.split(","):
        model = model_path(name)
        label = Path(name).name  # the tables' and profiles' name: random-512, not its temp dir
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
                          args.simulated_workers, args.repeats, again, guard,
                          args.serving_per_case)  # fmt: skip
        # After each model, so a later model's failure keeps the earlier figures.
        (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "table.md").write_text(table(rows) + "\n")
    plot(rows, out / "plan_validation.png")
    print(table(rows))
    print(f"\nwrote {out}/results.json, table.md and plan_validation.png")


if __name__ == "__main__":
    main()
