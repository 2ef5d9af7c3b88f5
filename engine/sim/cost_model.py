"""The cost model: a step's seconds from its batch shape, a KV transfer's seconds from its bytes.

A batch is described by its rows, each ``(num_new_tokens, num_computed_tokens)`` as the scheduler
made it (``SchedulerOutput``). The step time is linear in seven features of that shape:

    steps             1 per step (fixed launch and bookkeeping cost)
    tokens            new tokens in the batch (projections and MLP: linear in tokens)
    rows              sequences in the batch (per-sequence input preparation and sampling)
    prefill_rows      rows with q > 1 (each takes the extend-attention path: masks, its own call)
    prefix_attention  query-key pairs of the prefill rows over their cached prefix: q * context
    causal_attention  query-key pairs of the prefill rows among their new tokens: q * (q + 1) / 2
    decode_context    keys read by the decode rows (q == 1): context + 1

The two attention features are apart because they cost differently: the prefix is read from the
paged cache, the new tokens attend to each other as one dense causal block (on the demo model on
a CPU, a prefix pair costs four times a causal pair; one feature for both over-predicted a
254-token prompt by a third). ``prefill_rows`` is the fixed cost of a prompt that a decode row
does not pay.

``fit_linear`` fits non-negative coefficients, weighting each point by 1 / seconds so short and
long steps count alike (relative error). Pure and torch-free: the simulated runner, the
discrete-event simulator and the profiler share it; numpy is imported only to fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

STEP_FEATURES = (
    "steps", "tokens", "rows", "prefill_rows", "prefix_attention", "causal_attention",
    "decode_context",
)  # fmt: skip
TRANSFER_FEATURES = ("transfers", "bytes")


def step_features(rows: Iterable[tuple[int, int]]) -> tuple[float, ...]:
    """The features of one batch, from ``(num_new_tokens, num_computed_tokens)`` per row."""
    tokens = n_rows = prefill_rows = decode_ctx = 0
    prefix_pairs = causal_pairs = 0.0
    for q, ctx in rows:
        tokens += q
        n_rows += 1
        if q > 1:
            prefill_rows += 1
            prefix_pairs += q * ctx
            causal_pairs += q * (q + 1) / 2
        else:
            decode_ctx += ctx + 1
    return (
        1.0, float(tokens), float(n_rows), float(prefill_rows), float(prefix_pairs),
        causal_pairs, float(decode_ctx),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LinearModel:
    """seconds = sum(coefficients[i] * features[i]); coefficients are non-negative."""

    features: tuple[str, ...]
    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.features) != len(self.coefficients):
            raise ValueError("a linear model needs one coefficient per feature")
        for name, c in zip(self.features, self.coefficients, strict=True):
            if not c >= 0.0 or c == float("inf"):
                raise ValueError(f"coefficient of {name!r} must be finite and >= 0, got {c!r}")

    def predict(self, values: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coefficients, values, strict=True))

    def scaled(self, factor: float) -> LinearModel:
        """Every prediction ``factor`` times this one's."""
        return LinearModel(self.features, tuple(c * factor for c in self.coefficients))


def fit_linear(
    features: tuple[str, ...], xs: Sequence[Sequence[float]], ys: Sequence[float]
) -> LinearModel:
    """Non-negative least squares in relative error (rows weighted by 1 / y).

    Active-set by elimination: solve, drop the most negative coefficient, solve again. With a
    handful of features this reaches the NNLS optimum on well-conditioned grids; features that
    never vary (all zero) get coefficient 0.
    """
    import numpy as np

    if len(xs) != len(ys) or not xs:
        raise ValueError("fit_linear needs as many feature rows as targets, at least one")
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape[1] != len(features):
        raise ValueError(f"feature rows have {x.shape[1]} values for {len(features)} features")
    if not np.all(y > 0):
        raise ValueError("every measured time must be > 0")
    w = 1.0 / y
    active = [i for i in range(len(features)) if np.any(x[:, i] != 0)]
    coef = np.zeros(len(features))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return LinearModel(features, tuple(float(c) for c in coef))


def relative_errors(
    model: LinearModel, xs: Sequence[Sequence[float]], ys: Sequence[float]
) -> list[float]:
    """|predicted - measured| / measured for every point (fit quality, stored in the profile)."""
    return [abs(model.predict(x) - y) / y for x, y in zip(xs, ys, strict=True)]


@dataclass(frozen=True, slots=True)
class StepCost:
    """A worker's step: ``execute`` (the forward pass and sampling, what a simulated runner
    waits) plus ``host`` (scheduling, output processing and the worker thread's own work around
    it, which a simulated worker really runs and the discrete-event simulator must add)."""

    execute: LinearModel
    host: LinearModel

    def execute_seconds(self, rows: Iterable[tuple[int, int]]) -> float:
        return self.execute.predict(step_features(rows))

    def step_seconds(self, rows: Iterable[tuple[int, int]]) -> float:
        f = step_features(rows)
        return self.execute.predict(f) + self.host.predict(f)

    def scaled(self, factor: float) -> StepCost:
        """The same steps on a machine ``factor`` times slower (a benchmark's diagnostic: its
        steps at the pace a run measured)."""
        return StepCost(self.execute.scaled(factor), self.host.scaled(factor))


@dataclass(frozen=True, slots=True)
class TransferCost:
    """KV transfer time per transport: ``fixed + bytes * per_byte`` (one pull of one request,
    handshake excluded: a worker pair handshakes once)."""

    models: dict[str, LinearModel]

    def seconds(self, transport: str, num_bytes: int) -> float:
        model = self.models.get(transport)
        if model is None:
            raise ValueError(
                f"the profile has no KV transfer model for {transport!r}; "
                f"it has {', '.join(sorted(self.models)) or 'none'}"
            )
        return model.predict((1.0, float(num_bytes)))
