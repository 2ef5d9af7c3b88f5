"""How close can a prediction come? The noise floor of ``plan_validation.py``'s 25 % test.

A case's measured p90 moves from round to round (the host's pace over minutes, the tail of a
few dozen requests), and so does its prediction (each round is predicted from the profile made
just before it, in its own minutes). Read from saved runs (their ``results.json``), per case
class (model, load, deployment; three workloads each):

- each round's *residuals*: its measured and predicted log p90s (TTFT and ITL) less their
  means over the case's rounds, scaled by sqrt(n / (n - 1)) for those means' share of the n
  rounds; a round's four are kept together (its profile shares part of its cases' pace, and
  TTFT and ITL share the round), and shown as their RMS (SD) and correlations;
- ``bias``: per workload, the mean over the runs of log(predicted / measured), each the median
  of its rounds (shown as a percentage).

Then, drawing rounds from a class's residuals with replacement (seeded), the chance that a case
passes (TTFT and ITL both: the median of R rounds' predictions within 25 % of the median of R
measurements) for a *perfect* predictor, which knows each case's centre, and for an *unbiased*
one that moves from round to round as the simulator's predictions did; per run of every case,
the chance that all pass (cases taken as independent; a run's rounds share the host's pace, so
if anything it is higher) and the mean number that pass. Beside them, what the runs scored
(biases included), in a single round, and judged by the median of each round's own error (a
diagnostic: each prediction against the round it was profiled for). Resampling keeps the
residuals' heavy tails (one round from a profile made in a slow stretch), which a normal model
would spread over every round.

    python benchmarks/plan_noise.py /tmp/pv_r51 /tmp/pv_r52          # runs of the same code
    python benchmarks/plan_noise.py /tmp/pv_r51 --rounds 3,5,7,9
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from plan_report import Row, row_from_json

TOLERANCE = 0.25  # plan_report's: a check passes within 25 %
METRICS = ("ttft", "itl")
TRIALS = 100_000


@dataclass(frozen=True, slots=True)
class ClassNoise:
    """One case class's round residuals (log units) over the runs read, TTFT and ITL of a round
    kept together (they share its pace), and the bias of each of its workloads."""

    model: str
    load: str
    deployment: str
    # Per round: (measured TTFT, predicted TTFT, measured ITL, predicted ITL).
    residuals: tuple[tuple[float, float, float, float], ...]
    bias: dict[str, tuple[float, float]]  # per workload: (TTFT, ITL) mean log(predicted/measured)

    def sd(self, column: int) -> float:
        return math.sqrt(statistics.fmean(r[column] ** 2 for r in self.residuals))

    def correlation(self, a: int, b: int) -> float:
        cov = statistics.fmean(r[a] * r[b] for r in self.residuals)
        sd = self.sd(a) * self.sd(b)
        return cov / sd if sd else 0.0


def _log_median(values: list[float]) -> float:
    return math.log(statistics.median(values))


def case_residuals(*series: list[float]) -> list[tuple[float, ...]]:
    """A case's rounds as log deviations of each series (the same rounds) from its mean over
    them, scaled up for the mean's own share of the rounds (sqrt(n / (n - 1)))."""
    n = len(series[0])
    scale = math.sqrt(n / (n - 1))
    logs = [[math.log(v) for v in s] for s in series]
    means = [statistics.fmean(s) for s in logs]
    return [tuple((s[i] - mu) * scale for s, mu in zip(logs, means, strict=True))
            for i in range(n)]  # fmt: skip


def _rounds(r: Row) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
    """Per metric: (measured, predicted) p90 of each round."""
    return {"ttft": (r.ttft_rounds, r.predicted_ttft_rounds),
            "itl": (r.itl_rounds, r.predicted_itl_rounds)}  # fmt: skip


def class_noise(rows: list[Row]) -> list[ClassNoise]:
    """Every class's ``ClassNoise`` from ``rows`` (the rows of one or more runs, each with at
    least two rounds)."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.load, r.deployment), []).append(r)
    out = []
    for (model, load, dep), cases in sorted(groups.items()):
        residuals = []
        errors: dict[str, list[tuple[float, float]]] = {}
        for r in cases:
            rounds = _rounds(r)
            residuals += case_residuals(*(s for k in METRICS for s in rounds[k]))
            errors.setdefault(r.workload, []).append(tuple(
                _log_median(list(rounds[k][1])) - _log_median(list(rounds[k][0]))
                for k in METRICS
            ))  # fmt: skip
        bias = {w: (statistics.fmean(e[0] for e in es), statistics.fmean(e[1] for e in es))
                for w, es in sorted(errors.items())}  # fmt: skip
        out.append(ClassNoise(model, load, dep, tuple(residuals), bias))
    return out


def pass_chance(c: ClassNoise, rounds: int, spread: bool, bias: tuple[float, float],
                seed: int = 0) -> float:  # fmt: skip
    """The chance that a case of class ``c`` passes: for TTFT and ITL both, the prediction
    (the median of ``rounds`` rounds, shifted by ``bias``; with ``spread`` each round moves by
    its residual, else it is the centre) within ``TOLERANCE`` of the measurement (the median
    of the same rounds' measured residuals). Rounds are drawn from ``c.residuals`` with
    replacement, ``TRIALS`` times."""
    rows = np.asarray(c.residuals)
    draw = np.random.default_rng(seed).integers(0, len(rows), (TRIALS, rounds))
    ok = np.ones(TRIALS, dtype=bool)
    for i, b in enumerate(bias):
        m = np.median(np.exp(rows[draw, 2 * i]), axis=1)
        p = np.median(np.exp(rows[draw, 2 * i + 1]), axis=1) if spread else np.ones(TRIALS)
        ok &= np.abs(p * math.exp(b) / m - 1) <= TOLERANCE
    return float(np.mean(ok))


@dataclass(frozen=True, slots=True)
class RunOdds:
    """Per run of every case: the chance all pass, and the mean number that pass."""

    all_pass: float
    mean_cases: float


def run_odds(classes: list[ClassNoise], rounds: int, spread: bool) -> RunOdds:
    """A run's odds with ``rounds`` rounds per case, for a predictor without bias: the measured
    spread always, the simulator's own with ``spread`` (without: a perfect predictor, which
    knows each case's centre). Cases are taken as independent: rounds of one run share a
    pace, so the chance all pass is, if anything, higher."""
    all_pass, mean = 1.0, 0.0
    for c in classes:
        case = pass_chance(c, rounds, spread, (0.0, 0.0))  # the same for each workload
        all_pass *= case ** len(c.bias)
        mean += case * len(c.bias)
    return RunOdds(all_pass, mean)


def _within(measured: float, predicted: float) -> bool:
    return abs(predicted / measured - 1) <= TOLERANCE


@dataclass(frozen=True, slots=True)
class Observed:
    """What the runs scored, per run of every case on average: cases within 25 % against their
    medians (``plan_report``'s count), the mean over a case's rounds of those within against
    their own prediction, summed over the cases, and cases whose median over rounds of the
    per-round error is within (``paired``: each round judged against the profile made just
    before it, a diagnostic)."""

    cases: float
    singles: float
    paired: float


def observed(rows: list[Row], runs: int) -> Observed:
    """``Observed`` over ``rows``, the cases of ``runs`` runs."""
    runs = max(1, runs)
    cases = singles = paired = 0.0
    for r in rows:
        cases += abs(r.ttft_error) <= TOLERANCE and abs(r.itl_error) <= TOLERANCE
        singles += r.rounds_within / len(r.ttft_rounds)
        paired += all(
            _within(1.0, statistics.median([p / m for m, p in zip(*pair, strict=True)]))
            for pair in _rounds(r).values()
        )
    return Observed(cases / runs, singles / runs, paired / runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="plan_validation.py --out folders")
    ap.add_argument("--rounds", default="3,5,7,9", help="rounds per case to evaluate")
    args = ap.parse_args()
    rows = [row_from_json(r) for run in args.runs
            for r in json.loads((Path(run) / "results.json").read_text())]  # fmt: skip
    rows = [r for r in rows if len(r.ttft_rounds) >= 2]
    classes = class_noise(rows)
    print(f"{len(rows)} cases from {len(args.runs)} runs\n")
    print("| model | load | deployment | TTFT SD measured, predicted (correlation) | "
          "ITL SD measured, predicted (correlation) | bias by workload: TTFT, ITL |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for c in classes:
        bias = "; ".join(f"{w} {math.exp(t) - 1:+.0%}, {math.exp(i) - 1:+.0%}"
                         for w, (t, i) in c.bias.items())  # fmt: skip
        print(f"| {c.model} | {c.load} | {c.deployment} | {c.sd(0):.3f}, {c.sd(1):.3f} "
              f"({c.correlation(0, 1):+.2f}) | {c.sd(2):.3f}, {c.sd(3):.3f} "
              f"({c.correlation(2, 3):+.2f}) | {bias} |")  # fmt: skip
    cases = sum(len(c.bias) for c in classes)
    print("\n| rounds | perfect: all pass | perfect: cases (mean) | unbiased: all pass | "
          "unbiased: cases (mean) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.rounds.split(",")]:
        perfect = run_odds(classes, n, spread=False)
        unbiased = run_odds(classes, n, spread=True)
        print(f"| {n} | {perfect.all_pass:.2f} | {perfect.mean_cases:.1f} of {cases} | "
              f"{unbiased.all_pass:.2f} | {unbiased.mean_cases:.1f} of {cases} |")  # fmt: skip
    got = observed(rows, len(args.runs))
    print(f"\nThe runs scored {got.cases:.1f} of {cases} cases per run on average (biases "
          f"included), {got.singles:.1f} of {cases} in a single round, and {got.paired:.1f} "
          f"judged by the median of each round's own error (a diagnostic).")  # fmt: skip


if __name__ == "__main__":
    main()
