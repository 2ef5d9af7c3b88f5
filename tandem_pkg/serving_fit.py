"""Make the simulator reproduce the serving stage's own measurements (``tandem profile``).

The serving stage (``calibrate.py``) times lone requests on the machine's shared cores, the
client included, and derives its latencies by subtracting the step model: the step overhead
from the median ITL, the router's part from the first token, the hand-off from the 1P1D gap.
Those measured latencies already hold what the sharing cost, and the CPU the simulator charges
on top (a request's worker CPU taken from its next step, the streaming thread's, the router's
and the client's CPU on the shared cores) happened inside them too. Simulated in the
calibration's own conditions, a profile so came out above its own measurements: a lone
request's ITL by 15-22 % and its first token by 2.5-3.2 ms (the worker's request CPU, counted in
the router's part and again before the prefill step).

:func:`fit_serving` closes that loop: it simulates the calibration's scenarios (lone requests
of ``isl`` and ``osl`` tokens, colocated and 1P1D, with variability off, on the calibration's
cores with its client) and moves ``step_seconds``, ``request_seconds`` (with
``request_spread``) and ``handoff_seconds`` until the simulator's medians equal the measured
ones. The figures then mean what the simulator needs: serving latency beyond what it models.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.engine.sim.profile import Profile, ServingCost
from tandem.planner.sim_worker import POLL_SECONDS
from tandem.planner.simulator import Deployment, SimOptions, simulate
from tandem.planner.workload import Arrival, Lengths, Workload

ROUNDS = 8  # fixed-point iterations: each moves every figure by its whole remaining error
LONE_REQUESTS = 12


def _lone(profile: Profile, cores: int, transport: str, prefill: int, isl: int, osl: int
          ) -> tuple[float, float]:  # fmt: skip
    """The simulator's median (ITL, TTFT) of lone requests, spaced far apart."""
    w = Workload(rate=0.5, isl=Lengths(isl), osl=Lengths(osl), num_requests=LONE_REQUESTS,
                 arrival=Arrival.CONSTANT)  # fmt: skip
    options = SimOptions(seed=0, shared_cores=cores, variability=False, client_shares_cores=True)
    r = simulate(profile, w, Deployment(prefill=prefill, decode=1, kv_transport=transport), options)
    return r.itl.p50, r.ttft.p50


def fit_serving(profile: Profile, cores: int, transport: str, isl: int, osl: int) -> Profile:
    """``profile`` with its serving latencies moved so the simulator, run in the calibration's
    conditions (lone requests of ``isl``/``osl`` tokens on ``cores`` shared cores, the client
    on them, KV over ``transport``), reproduces the calibration's medians, which
    ``serving_cost``'s figures give back: the ITL (decode step + ``step_seconds``), the first
    token (prefill step + ``step_seconds`` + ``request_seconds`` + ``token_seconds``) and the
    1P1D gap from the first token to the second (pull + half a poll + one decode step +
    ``step_seconds`` + ``handoff_seconds``). A figure stops at 0 where the simulator is above
    its target even without it."""
    sv, step = profile.serving, profile.step
    blocks = -(-isl // profile.engine.block_size)
    pull = profile.transfer.seconds(transport, blocks * profile.engine.block_bytes)
    itl = step.step_seconds([(1, isl + osl // 2)]) + sv.step_seconds
    first = step.step_seconds([(isl, 0)]) + sv.step_seconds + sv.request_seconds + sv.token_seconds
    gap = (sv.handoff_seconds + pull + POLL_SECONDS / 2 + step.step_seconds([(1, isl)])
           + sv.step_seconds)  # fmt: skip
    for _ in range(ROUNDS):
        s = profile.serving
        got_itl, got_first = _lone(profile, cores, transport, 0, isl, osl)
        request = max(0.0, s.request_seconds + first - got_first)
        shift = request - s.request_seconds
        s = replace(
            s, step_seconds=max(0.0, s.step_seconds + itl - got_itl), request_seconds=request,
            request_spread=tuple(max(0.0, x + shift) for x in s.request_spread),
        )  # fmt: skip
        profile = replace(profile, serving=s)
        # A two-token 1P1D request's ITL is its gap from the first token to the second.
        got_gap, _ = _lone(profile, cores, transport, 1, isl, 2)
        s = replace(s, handoff_seconds=max(0.0, s.handoff_seconds + gap - got_gap))
        profile = replace(profile, serving=s)
    return replace(profile, serving=_rounded(profile.serving))


def _rounded(s: ServingCost) -> ServingCost:
    return replace(
        s, step_seconds=round(s.step_seconds, 7), request_seconds=round(s.request_seconds, 6),
        handoff_seconds=round(s.handoff_seconds, 6),
        request_spread=tuple(round(x, 6) for x in s.request_spread),
    )  # fmt: skip
