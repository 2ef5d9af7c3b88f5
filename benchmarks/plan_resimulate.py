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

from tandem.engine.cpu_threads import available_cpus
from tandem.engine.sim.profile import load_profile


def _profiles(run: Path, model: str, rounds: int) -> list[Path]:
    first = run / f"profile-{model}.json"
    later = [run / f"profile-{model}-round{r + 1}.json" for r in range(1, rounds)]
    # A run made with --one-profile (or --profile) has no later profiles: the first for all.
    return [first] + [p if p.exists() else first for p in later]


def _case_profile(run: Path, row: Row, rnd: int) -> Path | None:
    """The profile a ``--serving-per-case`` run saved for ``row``'s round ``rnd``, if any."""
    own = case_dir(run, row.model, row.workload, row.load, row.deployment, rnd) / "profile.json"
    return own if own.exists() else None


def resimulate(run: Path, cores: int, per_case: bool = True) -> list[Row]:
    """Every row of ``run``'s results, its predictions made again from the run's profiles: a
    case's own (its serving costs measured just before it, ``--serving-per-case``) where the
    run saved one and ``per_case``, else its round's."""
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
    args = ap.parse_args()
    print(table(resimulate(args.run, args.cores, per_case=not args.run_profiles)))


if __name__ == "__main__":
    main()
