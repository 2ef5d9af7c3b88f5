"""A profile moved to the machine's pace of the moment: a shared host's speed drifts.

A profile carries the pace of the minutes it was measured in. On a shared virtual machine that
pace moves by tens of percent within an hour (docs/planning.md, rounds 14-16), so a prediction
made from a profile an hour old is off by as much, whatever the simulator does. A pace probe
re-times a few of the profile's own step points on the same engine just before a run;
``pace_factor`` compares them with the profile's figures for the same points, and ``at_pace``
scales every time in the profile by that factor (the engine's steps, the Python around them and
the KV transfers alike: on a CPU host all of them run on the cores whose speed moved).

Who calls: ``benchmarks/plan_validation.py`` (``--pace-probe``), which owns the probing engine.
Pure: no torch, no engine; the probe's timings come in as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace

from tandem.engine.sim.cost_model import LinearModel, StepCost, TransferCost
from tandem.engine.sim.profile import Profile, ServingCost

# ServingCost fields that are not seconds: quantiles of ratios to a median.
_RATIOS = frozenset({"request_spread", "pace_spread"})


def _scaled(model: LinearModel, factor: float) -> LinearModel:
    return LinearModel(model.features, tuple(c * factor for c in model.coefficients))


def at_pace(profile: Profile, factor: float) -> Profile:
    """``profile`` with every duration multiplied by ``factor`` (> 0; 1.2: the machine runs
    20 % slower than when it was profiled). Its points stay as measured."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"a pace factor must be finite and > 0, got {factor!r}")
    sv = profile.serving
    serving = ServingCost(**{
        f.name: getattr(sv, f.name) if f.name in _RATIOS else getattr(sv, f.name) * factor
        for f in fields(ServingCost)
    })  # fmt: skip
    return replace(
        profile,
        step=StepCost(_scaled(profile.step.execute, factor), _scaled(profile.step.host, factor)),
        transfer=TransferCost({t: _scaled(m, factor) for t, m in profile.transfer.models.items()}),
        serving=serving,
    )


def probe_labels(profile: Profile) -> list[str]:
    """The step points a probe re-times: the smallest decode batch at its shortest context,
    the largest decode batch of at most 8 at its shortest, and the shortest prompt of at least
    64 tokens without a prefix: a light load's decode and a prompt's prefill, a few seconds
    in all. Only points the profile has (a probe compares like with like)."""
    decode: dict[int, tuple[int, str]] = {}
    prefill: list[tuple[int, str]] = []
    for p in profile.step_points:
        kind, *parts = p.label.split()
        values = dict(part.split("=", 1) for part in parts)
        if kind == "decode":
            batch, ctx = int(values["batch"]), int(values["ctx"])
            if batch not in decode or ctx < decode[batch][0]:
                decode[batch] = (ctx, p.label)
        elif kind == "prefill" and int(values["ctx"]) == 0 and int(values["q"]) >= 64:
            prefill.append((int(values["q"]), p.label))
    labels = []
    if decode:
        labels.append(decode[min(decode)][1])
        small = [b for b in decode if b <= 8]
        if small and max(small) != min(decode):
            labels.append(decode[max(small)][1])
    if prefill:
        labels.append(min(prefill)[1])
    return labels


def pace_factor(profile: Profile, measured: Mapping[str, float]) -> float:
    """The geometric mean over ``measured`` (a point's label -> its execute seconds now, taken
    as the profiler takes them) of now / then. ValueError for a label the profile lacks."""
    then = {p.label: p.execute_seconds for p in profile.step_points}
    if not measured:
        raise ValueError("a pace needs at least one probed point")
    logs = []
    for label, seconds in measured.items():
        if label not in then:
            raise ValueError(f"the profile has no step point {label!r}")
        if not (seconds > 0 and then[label] > 0):
            raise ValueError(f"point {label!r}: times must be > 0")
        logs.append(math.log(seconds / then[label]))
    return math.exp(sum(logs) / len(logs))
