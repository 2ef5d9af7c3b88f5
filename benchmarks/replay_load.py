"""Replay a planner workload against a router: the same requests, at the same times.

The planner's simulator and a real deployment are compared on identical inputs: each
``WorkloadRequest`` (arrival offset, prompt token ids, output length) is sent at its offset as a
streamed ``/v1/completions`` request (token-id prompt, ``ignore_eos``, greedy), open loop, and
timed as guidellm times it: TTFT = first content chunk - send, ITL = (last chunk - first chunk) /
(completion tokens - 1), end-to-end = last chunk - send. Written by hand because guidellm cannot
replay a fixed schedule of token-id prompts (say so in reports that use it). The client is
``tandem.stream_client``'s, the one ``tandem profile`` measures its client CPU with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tandem.planner.workload import WorkloadRequest
from tandem.stream_client import StreamRejected, stream_completion


@dataclass(slots=True)
class Measured:
    arrival: float
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None
    first_gap: float | None = None  # first to second content chunk (1P1D: the hand-off)
    tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, req: WorkloadRequest,
               t0: float) -> Measured:  # fmt: skip
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    m = Measured(req.arrival)
    try:
        s = await stream_completion(client, url, model, list(req.prompt_token_ids),
                                    req.max_tokens)  # fmt: skip
    except StreamRejected as exc:
        m.error = str(exc)
        return m
    except (httpx.HTTPError, ValueError) as exc:
        m.error = repr(exc)
        return m
    m.tokens = s.tokens
    if not s.times:
        m.error = "no tokens"
        return m
    m.ttft = s.times[0]
    m.e2e = s.times[-1]
    if len(s.times) > 1:
        m.first_gap = s.times[1] - s.times[0]
    if m.tokens > 1:
        m.itl = (s.times[-1] - s.times[0]) / (m.tokens - 1)
    return m


async def _replay(url: str, model: str, reqs: Sequence[WorkloadRequest]) -> list[Measured]:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter() + 0.2
        return list(await asyncio.gather(*(_one(client, url, model, r, t0) for r in reqs)))


def replay(url: str, model: str, reqs: Sequence[WorkloadRequest]) -> list[Measured]:
    """Send every request at its arrival offset; returns one ``Measured`` per request."""
    return asyncio.run(_replay(url, model, reqs))
