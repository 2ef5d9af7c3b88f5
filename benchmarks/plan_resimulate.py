"""Re-simulate a saved ``plan_validation.py`` run with the current simulator.

The simulator is deterministic for a profile and a seed, so a change to it can be judged on a
run's real measurements without running them again: this reads the run's ``results.json``
(the cases, their rates and measured p90s) and its profiles (``profile-<model>.json`` for the
first round, ``profile-<model>-roundN.json`` for later ones), predicts every round again and
prints the table with the counts ``plan_validation.py`` prints. The requests are the run's own
(the same workload, seed and profile give the same requests). A run made with
``--serving-per-case`` saved each case's profile in its log folder: that one is used, unless
``--run-profiles`` (then: what the run's profiles alone predict).

    python benchmarks/plan_resimulate.py /tmp/planval            # every model of the run
    python benchmarks/plan_resimulate.py /tmp/planval --cores 2  # the cores the run shared
    python benchmarks/plan_resimulate.py /tmp/planval --cores 2 --pace-stretches  # round 40

``--pace-stretches`` (an experiment, docs/planning.md round 40): each round's prediction is
the p90 over the requests of ten simulations, the steps scaled by the deciles of the pace the
profile's own grid saw pass by pass (:func:`stretch_paces`), instead of one at the profile's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from plan_report import Row, row_from_json, table
from plan_validation import (
    DEPLOYMENTS,
    _simulate,
    case_dir,
    case_workload,
    engine_seconds,
    front_role,
    workloads,
)

from tandem.calibrate import quantiles
from tandem.engine.cpu_threads import available_cpus
from tandem.engine.sim.profile import Profile, load_profile
from tandem.planner.metrics import Percentiles
from tandem.planner.workload import Workload

PASSES = 3  # tandem profile's passes over the step grid (a point's samples, pass by pass)


def stretch_paces(profile: Profile, passes: int = PASSES) -> tuple[float, ...]:
    """The deciles of the machine's pace as the profile's step grid saw it: for every point
    and pass, the median of that pass's samples over the point's time (their lower quartile),
    divided by the median of all of them (the serving costs were measured at that pace). A pass
    over one point lasts a second or more, and the pace holds for seconds: a prefill or a whole
    request runs at one of these, where the simulator's own pace windows last one request's
    decode. Points whose samples do not split into ``passes`` equal parts are skipped."""
    ratios = []
    for pt in profile.step_points:
        n, rest = divmod(len(pt.samples), passes)
        if n < 2 or rest:
            continue
        ratios += [statistics.median(pt.samples[k * n:(k + 1) * n]) / pt.execute_seconds
                   for k in range(passes)]  # fmt: skip
    if not ratios:
        return (1.0,)
    mid = statistics.median(ratios)
    return tuple(q / mid for q in quantiles(ratios))


def stretched_p90s(path: Path, w: Workload, p: int, d: int, cores: int) -> tuple[float, float]:
    """(TTFT p90, ITL p90) over the requests of one simulation per :func:`stretch_paces`
    decile, each as plan_validation.py predicts a case with the steps scaled by it."""
    ttfts: list[float] = []
    itls: list[float] = []
    for pace in stretch_paces(load_profile(path)):
        res = _simulate(path, w, p, d, cores, simulated=False, pace=pace)
        ttfts += [t.ttft for t in res.traces if t.ttft is not None]
        itls += [t.itl for t in res.traces if t.itl is not None]
    return Percentiles.of(ttfts).p90, Percentiles.of(itls).p90


def _profiles(run: Path, model: str, rounds: int) -> list[Path]:
    first = run / f"profile-{model}.json"
    later = [run / f"profile-{model}-round{r + 1}.json" for r in range(1, rounds)]
    # A run made with --one-profile (or --profile) has no later profiles: the first for all.
    return [first] + [p if p.exists() else first for p in later]


def _case_profile(run: Path, row: Row, rnd: int) -> Path | None:
    """The profile a ``--serving-per-case`` run saved for ``row``'s round ``rnd``, if any."""
    own = case_dir(run, row.model, row.workload, row.load, row.deployment, rnd) / "profile.json"
    return own if own.exists() else None


def resimulate(run: Path, cores: int, per_case: bool = True,
               stretches: bool = False) -> list[Row]:  # fmt: skip
    """Every row of ``run``'s results, its predictions made again from the run's profiles: a
    case's own (its serving costs measured just before it, ``--serving-per-case``) where the
    run saved one and ``per_case``, else its round's. ``stretches``: the TTFT and ITL p90s
    are :func:`stretched_p90s` (the rest as without)."""
    rows = []
    for r in json.loads((run / "results.json").read_text()):
        row = row_from_json(r)
        paths = _profiles(run, row.model, len(row.ttft_rounds))
        isl, osl = workloads(load_profile(paths[0]).model.max_model_len)[row.workload]
        w = case_workload(row.rate, isl, osl, row.requests)
        p, d = DEPLOYMENTS[row.deployment]
        if per_case:
            paths = [_case_profile(run, row, rnd) or path for rnd, path in enumerate(paths)]
        sims = [_simulate(path, w, p, d, cores, simulated=False) for path in paths]
        t, i = tuple(x.ttft.p90 for x in sims), tuple(x.itl.p90 for x in sims)
        if stretches:
            pooled = [stretched_p90s(path, w, p, d, cores) for path in paths]
            t, i = tuple(x for x, _ in pooled), tuple(y for _, y in pooled)
        worker = tuple(x.pools[front_role(p)].first_token.p90 for x in sims)
        worker = worker if row.worker_ttft_rounds else ()  # an older run measured none
        # The steps' pace of each round, against this simulator's steps (an older run: none).
        steps = tuple(engine_seconds(x) for x in sims) if row.busy_rounds else ()
        paced = [
            _simulate(path, w, p, d, cores, simulated=False, pace=busy / s)
            for path, busy, s in zip(paths, row.busy_rounds, steps, strict=True)
        ] if steps else []  # fmt: skip
        rows.append(replace(
            row, predicted_ttft_p90=statistics.median(t), predicted_itl_p90=statistics.median(i),
            predicted_ttft_rounds=t, predicted_itl_rounds=i, predicted_worker_ttft_rounds=worker,
            predicted_busy_rounds=steps, paced_ttft_rounds=tuple(x.ttft.p90 for x in paced),
            paced_itl_rounds=tuple(x.itl.p90 for x in paced),
        ))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a plan_validation.py --out directory")
    ap.add_argument(
        "--cores",
        type=int,
        default=available_cpus(),
        help="cores the run's workers shared (the simulator's shared_cores)",
    )
    ap.add_argument(
        "--run-profiles",
        action="store_true",
        help="predict from the run's profiles even where a case saved its own",
    )
    ap.add_argument(
        "--pace-stretches",
        action="store_true",
        help="each round's p90s over ten simulations at the profile's pass-by-pass paces",
    )
    args = ap.parse_args()
    rows = resimulate(args.run, args.cores, not args.run_profiles, args.pace_stretches)
    print(table(rows))


if __name__ == "__main__":
    main()
