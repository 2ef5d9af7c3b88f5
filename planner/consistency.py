"""The simulator made to give back its own calibration: lone requests on shared cores.

``tandem profile``'s serving stage (``tandem_pkg/calibrate.py``) times requests sent one at a
time through a real `tandem up` and stores what it measured less the step model: the step's
overhead (``ServingCost.step_seconds``) is the lone ITL less the decode step, the first token's
serving latency (``request_seconds``, ``token_seconds``, ``request_spread``) the lone first token
less the prefill step. Those lone figures already hold everything that ran beside the request on
the machine's cores: the router's loop, the worker's streaming thread, the client. The simulator
on shared cores (``planner/cores.py``) then charges that sharing again, and the worker's
request CPU a second time on the prefill step: simulated in the calibration's own conditions, a
profile of the demo model on a 2-core VM gave back a lone ITL 50 % and a first token 39 % above
the ones it was made from (docs/planning.md, round 31).

:func:`consistent` removes the double count from a profile before it is simulated on shared
cores. It lowers ``step_seconds`` until the simulated lone ITL (the median) equals the measured
one, then shifts the first token's serving latency down (``request_seconds`` and every
``request_spread`` quantile, by one amount) until the simulated lone first token (the median)
equals the measured one. Both by bisection on the simulator itself, so deterministic; neither
figure goes below zero, and a profile whose simulation already gives no more than the measured
figures keeps them. Called where a profile is about to be simulated on shared cores (``tandem
plan --shared-cores``, ``benchmarks/plan_validation.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tandem.engine.sim.profile import CALIBRATION_ISL, CALIBRATION_OSL, Profile
from tandem.planner.simulator import Deployment, SimOptions, run_simulation
from tandem.planner.workload import Arrival, Lengths, Workload

LONE_REQUESTS = 40  # requests of the simulated calibration (its medians are the figures)
BISECTIONS = 14  # each halves the interval: 2^-14 of the figure's measured value


def lone_targets(profile: Profile) -> tuple[float, float]:
    """(first token, ITL): the medians the serving calibration measured with lone requests,
    as its figures hold them (``calibrate.serving_cost`` split them into the step model and
    ``profile.serving``; this puts them back together)."""
    sv, step = profile.serving, profile.step
    itl = step.step_seconds([(1, CALIBRATION_ISL + CALIBRATION_OSL // 2)]) + sv.step_seconds
    ttft = (step.step_seconds([(CALIBRATION_ISL, 0)]) + sv.step_seconds + sv.row_seconds
            + sv.request_seconds + sv.token_seconds)  # fmt: skip
    return ttft, itl


def lone_latencies(profile: Profile, cores: int) -> tuple[float, float]:
    """(first token, ITL) medians the simulator predicts for the calibration's requests: one at
    a time on one colocated worker, the client on the same ``cores``."""
    dep = Deployment(prefill=0, decode=1)
    options = SimOptions(seed=0, shared_cores=cores, client_shares_cores=True)
    lengths = Lengths(CALIBRATION_ISL), Lengths(CALIBRATION_OSL)
    one = run_simulation(profile, Workload(1.0, *lengths, num_requests=1), dep, options)
    # Spaced by twice a lone request's time, so that each runs alone, as the calibration's do.
    gap = 2.0 * one.result.e2e.max + 0.005
    w = Workload(1.0 / gap, *lengths, num_requests=LONE_REQUESTS, arrival=Arrival.CONSTANT)
    result = run_simulation(profile, w, dep, options).result
    return result.ttft.p50, result.itl.p50


def _bisect(value: Callable[[float], float], target: float, hi: float) -> float:
    """The x in [0, hi] where ``value(x)`` falls to ``target`` (it falls as x grows): 0 if
    it is at or under ``target`` there, ``hi`` if still over at ``hi``."""
    if value(0.0) <= target:
        return 0.0
    if value(hi) > target:
        return hi
    lo = 0.0
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if value(mid) > target else (lo, mid)
    return hi


def _with(profile: Profile, step: float, shift: float) -> Profile:
    """``profile`` with step overhead ``step`` and its first token's serving latency (the
    request part and every spread quantile) ``shift`` seconds lower, neither below zero."""
    sv = profile.serving
    return replace(profile, serving=replace(
        sv, step_seconds=step, request_seconds=max(0.0, sv.request_seconds - shift),
        request_spread=tuple(max(0.0, q - shift) for q in sv.request_spread)))  # fmt: skip


def consistent(profile: Profile, cores: int) -> Profile:
    """``profile`` with the step overhead and the first token's serving latency lowered so
    that the simulator on ``cores`` shared cores gives back the lone ITL and first token the
    profile was calibrated from. Not for unshared cores, where nothing is counted twice.

    The ITL first: the step overhead is in the prefill step too, so the first token's shift
    is fitted at the fitted overhead (the shift leaves a lone request's ITL as it is)."""
    ttft, itl = lone_targets(profile)
    sv = profile.serving
    step = sv.step_seconds - _bisect(
        lambda x: lone_latencies(_with(profile, sv.step_seconds - x, 0.0), cores)[1],
        itl, sv.step_seconds)  # fmt: skip
    shift = _bisect(lambda x: lone_latencies(_with(profile, step, x), cores)[0], ttft,
                    sv.request_seconds)  # fmt: skip
    return _with(profile, step, shift)
