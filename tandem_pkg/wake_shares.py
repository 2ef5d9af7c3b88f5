"""Wake-up shares: how much of a serving thread's CPU per token is waking it up.

The serving stage (``calibrate.py``) measures CPU one request at a time, where every streamed
token finds the router's event loop, the client's and the worker's HTTP thread asleep: each
token pays a wake-up (the poll returning, the loop's turn, a system call per socket). With
several streams one wake-up serves every ready socket. Measured on the demo model in one
`tandem up`, the router's CPU per token fell from 100-126 us with one stream to 44-48 us with
eight, the client's from 72-76 to 27-28 us (docs/planning.md, round 23). Charging the lone cost
to every token made the simulator's CPU per request 11 % too high on median over five
validation runs, up to 2x for the decode-heavy workload.

The simulator's loops take their items in turns and charge the wake-up once a turn: to the item
that wakes the thread or, while it is busy, to the first that waits for its next turn
(``planner.sim_router.RouterLoop``); a worker's HTTP thread takes each step's rows in one
hand-over (``planner.sim_worker.SimWorker``). With a lone token's cost
``alone = c + w`` and the cost per token of ``B`` streams whose tokens arrive together (one
step makes them) ``batched = c + w / B``, the share of the lone cost that is the wake-up is

    share = (1 - batched / alone) * B / (B - 1), clamped to [0, 1].

A thread that wakes while every core is busy also waits for one, for up to the kernel's time
slice (``scheduler_slice``), half of it on average (``ServingCost.run_queue_wait``). Without
that wait the demo's TTFT p90 was 18-51 % under-predicted in a validation run
(docs/planning.md, round 24): its lone requests were predicted within 0.5-1.2 ms, the ones
beside another stream 2-4 ms early; with a whole slice, its 1P1D TTFT was 30-49 % over
(round 37).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

BATCH = 8  # streams sent at once in the batched phases (``stream_client.send_batches``)


def wake_share(alone: float, batched: float, batch: int = BATCH) -> float:
    """The share of ``alone`` (a lone item's CPU) that is waking the thread, from ``batched``
    (the CPU per item of ``batch`` items that arrive together); 0 where ``alone`` is 0."""
    if alone <= 0.0 or batch < 2:
        return 0.0
    return min(1.0, max(0.0, (1.0 - batched / alone) * batch / (batch - 1)))


# Linux's scheduler slice: base 0.75 ms scaled by 1 + log2(CPUs, at most 8) (the default
# logarithmic tunable scaling); EEVDF (6.6+) calls it base_slice, CFS min_granularity.
_SLICE_FILES = (
    "/sys/kernel/debug/sched/base_slice_ns",
    "/sys/kernel/debug/sched/min_granularity_ns",
)


def scheduler_slice(cpus: int | None = None, files: Sequence[str] = _SLICE_FILES) -> float:
    """The most a thread woken onto busy cores waits for one (``mean_run_queue_wait`` is half
    of it): the kernel's time slice, read from debugfs where it is mounted and readable,
    else the kernel's default for this many online CPUs."""
    for name in files:
        try:
            with open(name) as f:
                return int(f.read().strip()) / 1e9
        except (OSError, ValueError):
            continue
    n = max(1, min(cpus or os.cpu_count() or 1, 8))
    return 0.00075 * (1 + n.bit_length() - 1)


def mean_run_queue_wait(cpus: int | None = None, files: Sequence[str] = _SLICE_FILES) -> float:
    """What a thread woken onto busy cores waits for one on average (``ServingCost.
    run_queue_wait``, recorded by ``tandem profile``): half the kernel's slice, since it lands
    at a random point of the running thread's slice. A whole slice over-predicted the demo's
    1P1D TTFT by 30-49 % (docs/planning.md, round 37)."""
    return round(scheduler_slice(cpus, files) / 2, 6)
