"""Replay a planner workload against a router: the same requests, at the same times.

The planner's simulator and a real deployment are compared on identical inputs: each
``WorkloadRequest`` (arrival offset, prompt token ids, output length) is sent at its offset as a
streamed ``/v1/completions`` request (token-id prompt, ``ignore_eos``, greedy), open loop, and
timed as guidellm times it: TTFT = first content chunk - send, ITL = (last chunk - first chunk) /
(completion tokens - 1), end-to-end = last chunk - send. Written by hand because guidellm cannot
replay a fixed schedule of token-id prompts (say so in reports that use it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tandem.planner.workload import WorkloadRequest


@dataclass(slots=True)
class Measured:
    arrival: float
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, req: WorkloadRequest,
               t0: float) -> Measured:  # fmt: skip
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    sent = time.perf_counter()
    m = Measured(req.arrival)
    body = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                m.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return m
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    m.tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    first = first if first is not None else now
                    last = now
    except (httpx.HTTPError, ValueError) as exc:
        m.error = repr(exc)
        return m
    if first is None or last is None:
        m.error = "no tokens"
        return m
    m.ttft = first - sent
    m.e2e = last - sent
    if m.tokens > 1:
        m.itl = (last - first) / (m.tokens - 1)
    return m


async def _replay(url: str, model: str, reqs: Sequence[WorkloadRequest]) -> list[Measured]:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter() + 0.2
        return list(await asyncio.gather(*(_one(client, url, model, r, t0) for r in reqs)))


def replay(url: str, model: str, reqs: Sequence[WorkloadRequest]) -> list[Measured]:
    """Send every request at its arrival offset; returns one ``Measured`` per request."""
    return asyncio.run(_replay(url, model, reqs))
