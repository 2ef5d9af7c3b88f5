"""Measure the real engine's step time over a grid of batch shapes (the step half of a profile).

Called by ``tandem profile`` (``tandem_pkg/profile.py``). It builds the real engine from the
serving ``EngineConfig``, wraps its runner to time ``execute`` apart from the rest of
``Engine.step`` (scheduling, output processing: the host part), and drives the real scheduler
into each shape of the grid:

- prefill ``(q, ctx)``: a cached prefix of ``ctx`` tokens (one request run first), then requests
  whose prompt is that prefix plus ``q`` fresh tokens: each step computes exactly ``(q, ctx)``;
- decode ``(batch, ctx)``: ``batch`` requests with ``ctx``-token prompts, prefilled untimed, then
  timed decode steps;
- mixed ``(batch, ctx, q)``: those decodes plus a fresh ``q``-token prompt in the same step.

Every timed step records the rows the scheduler really made, so the fit uses true shapes. A
point's time is the lower quartile of its samples: another process can only make a step slower,
never faster, so on a busy machine the quartile stays near the step's own cost while a median
follows the interference (the profile records the spread, and ``tandem profile`` warns when it
is large: profile on a quiet machine).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.engine.engine import Engine
from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.engine.runner import StepRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim.cost_model import (
    STEP_FEATURES,
    LinearModel,
    fit_linear,
    relative_errors,
    step_features,
)
from tandem.engine.sim.profile import StepPoint


@dataclass(frozen=True, slots=True)
class StepGrid:
    prefill: tuple[tuple[int, int], ...]  # (q, ctx)
    decode: tuple[tuple[int, int], ...]  # (batch, ctx)
    mixed: tuple[tuple[int, int, int], ...]  # (batch, ctx, q)

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.mixed)


def _powers(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


# One timed step: the rows the scheduler made, execute seconds, host seconds.
Sample = tuple[list[tuple[int, int]], float, float]

# Untimed decode steps before a decode point's timed ones.
WARMUP_STEPS = 4
# Context room a decode point keeps for its timed steps (one per repeat: 9 by default, 12 at
# most; more repeats make the profiler refuse the points with the least room).
REPEATS_ROOM = 12


def default_grid(
    max_model_len: int, budget: int, max_num_seqs: int, num_blocks: int, block_size: int,
    quick: bool = False,
) -> StepGrid:  # fmt: skip
    """A grid that spans the serving range but stays small (a few minutes for the demo model)."""
    top = min(budget, max_model_len - 2, 2048)
    qs = _powers(16, top)
    if top > qs[-1]:  # the longest prompt too: a linear fit extrapolates poorly past its grid
        qs.append(top)
    ctx_fracs = (0, 4) if quick else (0, 4, 2)
    prefill = []
    for q in qs:
        for frac in ctx_fracs:
            ctx = 0 if frac == 0 else (max_model_len // frac) // block_size * block_size
            if q + ctx <= max_model_len - 2:
                prefill.append((q, ctx))
    ctxs = sorted({max(8, max_model_len // 8), max_model_len // 2, max_model_len * 7 // 8})
    batches = _powers(1, min(max_num_seqs, 128 if not quick else 32))
    decode = []
    for b in batches:
        for ctx in ctxs if not quick else ctxs[::2]:
            # Room for the steps that prefill the batch (the first decode meanwhile) and the
            # warm-up and timed steps, so no sequence finishes before it is timed.
            grows = -(-b * ctx // budget) + WARMUP_STEPS + REPEATS_ROOM
            blocks = b * (-(-(ctx + grows) // block_size))
            if blocks <= num_blocks and ctx + grows < max_model_len:
                decode.append((b, ctx))
    mixed = []
    q_mid = qs[len(qs) // 2]
    for b in (4, 16):
        if (
            b <= max_num_seqs
            and b * (ctxs[0] + 32) // block_size + q_mid // block_size < num_blocks
        ):
            mixed.append((b, ctxs[0], q_mid))
    return StepGrid(tuple(prefill), tuple(decode), tuple(mixed))


class _TimedRunner:
    """Delegates to the real runner and records each step's rows and execute seconds."""

    def __init__(self, inner: StepRunner) -> None:
        self.inner = inner
        self.device = inner.device
        self.kv_cache = inner.kv_cache
        self.last: tuple[list[tuple[int, int]], float] | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        rows = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled]
        t0 = time.perf_counter()
        result = self.inner.execute(out)
        self.last = (rows, time.perf_counter() - t0)
        return result


class StepProfiler:
    """Owns the engine it measures. ``run`` makes one pass over a grid and returns the points
    as measured so far; calling it again (``tandem profile --passes``) adds each point's samples
    of the new pass to those of the earlier ones, so a point's lower quartile is taken over
    passes minutes apart: this machine's pace moves in steps lasting minutes, which the
    repeats of one pass, a fraction of a second apart, all share. ``progress`` is called once
    per finished grid point (a progress bar's update)."""

    def __init__(self, engine: Engine, repeats: int = 9, seed: int = 0) -> None:
        self.engine = engine
        self.timed = _TimedRunner(engine.runner)
        engine.runner = self.timed
        self.repeats = repeats
        self._rng = random.Random(seed)
        self._ids = 0
        self._live: list[str] = []
        self._samples: dict[str, list[Sample]] = {}  # by point label, every pass's, in order
        vocab = engine.arch.vocab_size
        self._vocab = [t for t in range(vocab) if t not in engine.eos_token_ids]

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.choice(self._vocab) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._ids += 1
        rid = f"profile-{self._ids}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        self._live.append(rid)
        return rid

    def _timed_step(self) -> Sample:
        self.timed.last = None
        t0 = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - t0
        if self.timed.last is None:
            raise RuntimeError("the profiled step scheduled nothing")
        rows, execute = self.timed.last
        return rows, execute, max(total - execute, 0.0)

    def _drain(self) -> None:
        self.engine.abort(self._live)
        self._live = []

    def _decoding(self, batch: int, ctx: int) -> None:
        """``batch`` requests with ``ctx``-token prompts, stepped until all of them decode.

        The budget prefills them a few per step while the first ones already decode, so each
        may take the whole context's room: one that reached ``max_tokens`` before the timed
        steps would leave a smaller batch than the point names (``_checked`` refuses that)."""
        room = self.engine.max_model_len - ctx - 1
        for _ in range(batch):
            self._add(self._tokens(ctx), room)
        sched = self.engine.scheduler
        while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
            self.engine.step()
        # The first decode steps after the prefills run slow (up to 2.5x at one sequence on the
        # demo model, falling over three or four steps: caches refilled with the decode's own
        # data); serving decodes warm, so they are not timed.
        for _ in range(WARMUP_STEPS):
            self.engine.step()

    def _checked(self, label: str, sample: Sample, decodes: int) -> Sample:
        got = sum(1 for q, _ in sample[0] if q == 1)
        if got != decodes:
            raise RuntimeError(
                f"tandem profile: {label} timed a step of {got} decoding sequences, not "
                f"{decodes}: some finished early (too little context room for this point)"
            )
        return sample

    def _point(self, label: str, new: list[Sample], record: bool = True) -> StepPoint:
        # The point's time is the lower-quartile sample's over every pass so far, and so are its
        # rows (contexts grow a token per step). Warm-up points are not recorded.
        samples = new
        if record:
            samples = self._samples.setdefault(label, [])
            samples += new
        rows, execute, _ = sorted(samples, key=lambda s: s[1])[(len(samples) - 1) // 4]
        groups: dict[tuple[int, int], int] = {}
        for row in rows:
            groups[row] = groups.get(row, 0) + 1
        return StepPoint(
            label=label,
            rows=tuple((q, c, n) for (q, c), n in sorted(groups.items())),
            execute_seconds=execute,
            host_seconds=lower_quartile([s[2] for s in samples]),
            samples=tuple(s[1] for s in samples),
        )

    def prefill(self, q: int, ctx: int, record: bool = True) -> StepPoint:
        prefix = self._tokens(ctx)
        if ctx:
            self._add(prefix, 1)
            while self.engine.has_unfinished:
                self.engine.step()
            self._live = []
        samples = []
        for _ in range(self.repeats):
            self._add(prefix + self._tokens(q), 1)
            samples.append(self._timed_step())
            self._drain()
        return self._point(f"prefill q={q} ctx={ctx}", samples, record)

    def decode(self, batch: int, ctx: int, record: bool = True) -> StepPoint:
        label = f"decode batch={batch} ctx={ctx}"
        self._decoding(batch, ctx)
        samples = [self._checked(label, self._timed_step(), batch) for _ in range(self.repeats)]
        self._drain()
        return self._point(label, samples, record)

    def mixed(self, batch: int, ctx: int, q: int) -> StepPoint:
        label = f"mixed batch={batch} ctx={ctx} q={q}"
        self._decoding(batch, ctx)
        samples = []
        for _ in range(self.repeats):
            self._add(self._tokens(q), 1)
            samples.append(self._checked(label, self._timed_step(), batch))
        self._drain()
        return self._point(label, samples)

    def run(self, grid: StepGrid, progress: Callable[[], None] = lambda: None) -> list[StepPoint]:
        # Warm-up, each pass (the pass before may be minutes ago): first calls allocate and
        # pick kernels.
        self.decode(1, 16, record=False)
        self.prefill(16, 0, record=False)
        points = []
        for q, ctx in grid.prefill:
            points.append(self.prefill(q, ctx))
            progress()
        for batch, ctx in grid.decode:
            points.append(self.decode(batch, ctx))
            progress()
        for batch, ctx, q in grid.mixed:
            points.append(self.mixed(batch, ctx, q))
            progress()
        self.engine.check_integrity()
        return points


def lower_quartile(values: list[float]) -> float:
    v = sorted(values)
    return v[(len(v) - 1) // 4]


def spread(points: Iterable[StepPoint]) -> float:
    """Median over points of (upper - lower quartile) / lower quartile of the samples: ~0.1 on
    a quiet machine, above 1 when other work keeps preempting the engine."""
    ratios = []
    for p in points:
        v = sorted(p.samples)
        if len(v) >= 2 and v[(len(v) - 1) // 4] > 0:
            ratios.append(
                (v[(3 * (len(v) - 1)) // 4] - v[(len(v) - 1) // 4]) / v[(len(v) - 1) // 4]
            )
    return statistics.median(ratios) if ratios else 0.0


def fit_step_models(
    points: Iterable[StepPoint],
) -> tuple[LinearModel, LinearModel, dict[str, float]]:
    """Execute and host models, plus the execute model's relative error (p50, p90, max)."""
    pts = list(points)
    xs = [step_features(p.expanded()) for p in pts]
    execute = fit_linear(STEP_FEATURES, xs, [p.execute_seconds for p in pts])
    host_ys = [max(p.host_seconds, 1e-7) for p in pts]
    host = fit_linear(STEP_FEATURES, xs, host_ys)
    errs = sorted(relative_errors(execute, xs, [p.execute_seconds for p in pts]))
    fit = {
        "execute_rel_error_p50": errs[len(errs) // 2],
        "execute_rel_error_p90": errs[min(len(errs) - 1, int(0.9 * len(errs)))],
        "execute_rel_error_max": errs[-1],
        "points": float(len(pts)),
        "sample_spread": spread(pts),
    }
    return execute, host, fit
