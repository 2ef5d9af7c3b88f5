"""One streamed completion, timed as a load generator times it.

The serving stage of ``tandem profile`` (``calibrate.py``) and the planner's validation replay
(``benchmarks/replay_load.py``) send their requests through this one client, so the client CPU
the profile measures is the replay's: one asyncio ``httpx`` client that parses every chunk's
JSON, as guidellm does (a synchronous client cost 0.94 ms for a one-token request where this one
costs 1.10, and 1.54 against 2.26 ms for 16 tokens; docs/planning.md, round 25).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tandem.wake_shares import BATCH


class StreamRejected(httpx.HTTPError):
    """The router answered with a status other than 200; the message holds the status and the
    start of the body."""


@dataclass(frozen=True, slots=True)
class Streamed:
    times: tuple[float, ...]  # seconds from sending to each chunk with text
    tokens: int  # completion tokens reported in ``usage`` (0: none reported)


async def stream_completion(client: httpx.AsyncClient, url: str, model: str,
                            prompt: list[int], max_tokens: int) -> Streamed:  # fmt: skip
    """Stream one greedy completion of ``prompt`` (token ids, ``ignore_eos``) from the router at
    ``url``. A token whose text is held back (an incomplete UTF-8 sequence, as a random model
    makes) arrives with a later chunk, so there may be fewer times than tokens. Raises
    ``StreamRejected`` on a status other than 200, and ``httpx.HTTPError`` or ``ValueError`` (a
    chunk that is not JSON) when the stream breaks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise StreamRejected(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens", 0)
                if (chunk.get("choices") or [{}])[0].get("text"):
                    times.append(now - t0)
    return Streamed(tuple(times), tokens)


async def stream_times(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       max_tokens: int) -> list[float]:  # fmt: skip
    """``stream_completion``'s chunk times; [] unless all ``max_tokens`` tokens were
    generated."""
    s = await stream_completion(client, url, model, prompt, max_tokens)
    return list(s.times) if s.tokens == max_tokens else []


async def send_batches(client: httpx.AsyncClient, url: str, model: str,
                       prompts: Sequence[list[int]], max_tokens: int,
                       batch: int = BATCH) -> int:  # fmt: skip
    """Stream ``prompts`` to the router at ``url``, ``batch`` at a time (each group sent at
    once, the next when all have finished), on ``client``; returns how many were sent. An HTTP
    error propagates."""
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        await asyncio.gather(*(stream_times(client, url, model, p, max_tokens) for p in group))
    return len(prompts)
