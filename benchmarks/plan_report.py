"""plan_validation.py's report: a case's row (measured and predicted p90s, each round's), the
Markdown table with the counts the check is judged by, and the predicted-vs-measured plot.
Shared with plan_resimulate.py, which reports a saved run predicted again."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path


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
    # Each round's p90 of the first token's time inside the worker whose token the client sees
    # first (the prefill worker in 1P1D): measured from its histogram (as fine as its buckets),
    # predicted by the simulated worker. The rest of the TTFT is the serving path's.
    worker_ttft_rounds: tuple[float, ...] = ()
    predicted_worker_ttft_rounds: tuple[float, ...] = ()
    # Each round's step seconds over the replay, every worker's: measured (their
    # tandem_worker_busy_seconds_total) and simulated (PoolStats.engine_seconds). Their ratio is
    # the pace the machine ran the steps at against the simulator's.
    busy_rounds: tuple[float, ...] = ()
    predicted_busy_rounds: tuple[float, ...] = ()
    # Each round's prediction again with every step at that pace (StepCost.scaled): a
    # diagnostic, not the check. What it leaves is the model's error, not the host's pace.
    paced_ttft_rounds: tuple[float, ...] = ()
    paced_itl_rounds: tuple[float, ...] = ()
    # 1P1D only, each round's p90 of the decode worker's first token (arrival there, through
    # the pull, to its first step's token): measured from its histogram, and by the simulated
    # worker. The simulated hand-off (``ServingCost.handoff_seconds`` or a draw from
    # ``handoff_spread``) comes before the simulated worker's arrival, while most of the real
    # one is inside the real worker's pull: compare the two with it added.
    decode_ttft_rounds: tuple[float, ...] = ()
    predicted_decode_ttft_rounds: tuple[float, ...] = ()

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

    @property
    def pace_rounds(self) -> tuple[float, ...]:
        """Each round's measured over simulated step seconds (empty: not recorded)."""
        return tuple(m / p for m, p in zip(self.busy_rounds, self.predicted_busy_rounds,
                                           strict=True) if p > 0)  # fmt: skip

    def paced(self) -> Row:
        """This row judged on its predictions at each round's measured pace."""
        if not self.paced_ttft_rounds:
            return self
        t, i = self.paced_ttft_rounds, self.paced_itl_rounds
        return replace(self, predicted_ttft_p90=statistics.median(t),
                       predicted_itl_p90=statistics.median(i), predicted_ttft_rounds=t,
                       predicted_itl_rounds=i)  # fmt: skip

    def first_profile(self) -> Row:
        """This row judged on the first round's profile alone (the single-profile figures)."""
        if not self.predicted_ttft_rounds:
            return self
        t, i = self.predicted_ttft_rounds[0], self.predicted_itl_rounds[0]
        n = len(self.ttft_rounds)
        return replace(self, predicted_ttft_p90=t, predicted_itl_p90=i,
                       predicted_ttft_rounds=(t,) * n, predicted_itl_rounds=(i,) * n)  # fmt: skip


def row_from_json(r: dict) -> Row:
    """A ``Row`` from its ``results.json`` form (lists for tuples). A run saved by another
    version may carry columns this one does not know: they are dropped."""
    known = {f.name for f in fields(Row)}
    return Row(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items() if k in known})


def _span(values: tuple[float, ...], scale: float, unit: str, digits: int) -> str:
    if len(values) < 2:
        return ""
    return f" ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f} {unit})"


def _within(rows: list[Row]) -> tuple[int, int, int]:
    """(cases whose median errors are both within 25 %, single runs within against their own
    round's prediction, single runs)."""
    cases = sum(abs(r.ttft_error) <= 0.25 and abs(r.itl_error) <= 0.25 for r in rows)
    return cases, sum(r.rounds_within for r in rows), sum(len(r.ttft_rounds) for r in rows)


def _worker_cell(r: Row) -> str:
    """The first token's p90 inside the front worker, measured / predicted (medians of rounds);
    an empty cell for a run saved before it was recorded."""
    if not r.worker_ttft_rounds:
        return " |"
    m = statistics.median(r.worker_ttft_rounds)
    p = statistics.median(r.predicted_worker_ttft_rounds)
    return f" {m * 1e3:.1f} / {p * 1e3:.1f} ms |"


def _paced_cells(r: Row) -> str:
    """The steps' pace (median of rounds) and the errors of the prediction at it; empty cells
    for a run saved before they were recorded."""
    if not r.paced_ttft_rounds:
        return " | |"
    p = r.paced()
    return f" {statistics.median(r.pace_rounds):.2f} | {p.ttft_error:+.0%}, {p.itl_error:+.0%} |"


def table(rows: list[Row]) -> str:
    cpu = any(r.cpu_rounds for r in rows)
    worker = any(r.worker_ttft_rounds for r in rows)
    paced = any(r.paced_ttft_rounds for r in rows)
    lines = [
        "| model | workload | load | rate (req/s) | deployment | TTFT p90 measured (rounds) /"
        " predicted (rounds) (error) | ITL p90 measured (rounds) / predicted (rounds) (error) |"
        + (" CPU per request (rounds) |" if cpu else "")
        + (" of the TTFT, in the front worker: p90 measured / predicted |" if worker else "")
        + (
            " steps' pace: measured / simulated seconds | at that pace: TTFT, ITL error |"
            if paced
            else ""
        ),
        "| --- | --- | --- | ---: | --- | --- | --- |"
        + (" --- |" if cpu else "")
        + (" --- |" if worker else "")
        + (" ---: | --- |" if paced else ""),
    ]
    for r in rows:
        spent = " |" if cpu else ""  # a run saved before CPU was recorded: an empty cell
        if r.cpu_rounds:
            mid = statistics.median(r.cpu_rounds) * 1e3
            spent = f" {mid:.1f} ms{_span(r.cpu_rounds, 1e3, 'ms', 1)} |"
        if worker:
            spent += _worker_cell(r)
        if paced:
            spent += _paced_cells(r)
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
    if paced:
        within, single, runs = _within([r.paced() for r in rows])
        lines.append(
            f"At each round's measured pace (a diagnostic): {within} of {len(rows)} cases; "
            f"{single} of {runs} single runs."
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
