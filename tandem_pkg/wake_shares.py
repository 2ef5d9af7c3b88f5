"""Wake-up shares: how much of a serving thread's CPU per token is waking it up.

The serving stage (``calibrate.py``) measures CPU one request at a time, where every streamed
token finds the router's event loop, the client's and the worker's HTTP thread asleep: each
token pays a wake-up (the poll returning, the loop's turn, a system call per socket). With
several streams one wake-up serves every ready socket. Measured on the demo model in one
`tandem up`, the router's CPU per token fell from 100-126 us with one stream to 44-48 us with
eight, the client's from 72-76 to 27-28 us (docs/planning.md, round 23). Charging the lone cost
to every token made the simulator's CPU per request 11 % too high on median over five
validation runs, up to 2x for the decode-heavy workload.

The simulator's loops charge the wake-up only to the item that finds their thread idle
(``planner.sim_router.RouterLoop``, ``planner.sim_worker.SimWorker``). With a lone token's cost
``alone = c + w`` and the cost per token of ``B`` streams whose tokens arrive together (one
step makes them) ``batched = c + w / B``, the share of the lone cost that is the wake-up is

    share = (1 - batched / alone) * B / (B - 1), clamped to [0, 1].

A thread that wakes while every core is busy also waits for one, for up to the kernel's time
slice (``scheduler_slice``, ``ServingCost.run_queue_wait``). Without that wait the demo's TTFT
p90 was 18-51 % under-predicted in a validation run (docs/planning.md, round 24): its lone
requests were predicted within 0.5-1.2 ms, the ones beside another stream 2-4 ms early.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence

import httpx

BATCH = 8  # streams sent at once in the batched phases


def wake_share(alone: float, batched: float, batch: int = BATCH) -> float:
    """The share of ``alone`` (a lone item's CPU) that is waking the thread, from ``batched``
    (the CPU per item of ``batch`` items that arrive together); 0 where ``alone`` is 0."""
    if alone <= 0.0 or batch < 2:
        return 0.0
    return min(1.0, max(0.0, (1.0 - batched / alone) * batch / (batch - 1)))


async def stream_times(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       max_tokens: int) -> list[float]:  # fmt: skip
    """Stream one completion as a load generator does (each chunk's JSON parsed): the seconds
    from sending to each chunk with text; [] unless all ``max_tokens`` tokens were generated
    (``usage``). A token whose text is held back (an incomplete UTF-8 sequence, as a random
    model makes) arrives with a later chunk, so there may be fewer times than tokens. The
    serving stage's every phase uses it, so the client's CPU per token is the validation's
    asyncio client's, alone and batched alike. An HTTP error propagates."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens", 0)
                if (chunk.get("choices") or [{}])[0].get("text"):
                    times.append(time.perf_counter() - t0)
    return times if tokens == max_tokens else []


async def send_batches(client: httpx.AsyncClient, url: str, model: str,
                       prompts: Sequence[list[int]], max_tokens: int,
                       batch: int = BATCH) -> int:  # fmt: skip
    """Stream ``prompts`` to the router at ``url``, ``batch`` at a time (each group sent at
    once, the next when all have finished), on ``client`` (the validation's load generator is
    one asyncio client too); returns how many were sent. An HTTP error propagates."""
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        await asyncio.gather(*(stream_times(client, url, model, p, max_tokens) for p in group))
    return len(prompts)


# Linux's scheduler slice: base 0.75 ms scaled by 1 + log2(CPUs, at most 8) (the default
# logarithmic tunable scaling); EEVDF (6.6+) calls it base_slice, CFS min_granularity.
_SLICE_FILES = (
    "/sys/kernel/debug/sched/base_slice_ns",
    "/sys/kernel/debug/sched/min_granularity_ns",
)


def scheduler_slice(cpus: int | None = None, files: Sequence[str] = _SLICE_FILES) -> float:
    """Seconds a thread woken onto busy cores waits for one (``ServingCost.run_queue_wait``):
    the kernel's time slice, read from debugfs where it is mounted and readable, else the
    kernel's default for this many online CPUs."""
    for name in files:
        try:
            with open(name) as f:
                return int(f.read().strip()) / 1e9
        except (OSError, ValueError):
            continue
    n = max(1, min(cpus or os.cpu_count() or 1, 8))
    return 0.00075 * (1 + n.bit_length() - 1)
