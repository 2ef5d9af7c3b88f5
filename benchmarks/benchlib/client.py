"""The one streaming chat client of the benchmarks: what guidellm does not record.

guidellm reports per request the time to first token and the mean inter-token latency, not the
arrival time of each chunk, so the ITL tail of a stream and its timeline through a burst need this
client (as vLLM's ``benchmark_serving`` does, an inter-token gap is the gap between two content
chunks). The prefix-routing benchmark also uses it for its multi-turn sessions, whose next turn
carries the actual previous reply.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


def chat_body(model: str, messages: tuple[tuple[str, str], ...], max_tokens: int) -> dict:
    """A greedy streamed chat completion of exactly ``max_tokens`` tokens, with usage."""
    return {
        "model": model,
        "messages": [{"role": r, "content": c} for r, c in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(slots=True, frozen=True)
class StreamResult:
    reply: str
    ttft_s: float  # to the first non-empty content chunk
    e2e_s: float
    usage: dict[str, Any]
    start_wall: float  # time.time() when the request was sent
    chunk_walls: tuple[float, ...]  # time.time() of each non-empty content chunk

    def gaps(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive content chunks."""
        w = self.chunk_walls
        return [b - a for a, b in zip(w, w[1:], strict=False)]


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], walls: list[float] | None = None
) -> StreamResult:
    """One streamed chat completion through ``url`` (the router's base URL). Each content chunk's
    arrival time is appended to ``walls`` as it comes (a caller that cancels the stream keeps what
    arrived)."""
    start_wall = time.time()
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    walls = [] if walls is None else walls
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat completion failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text:
                    walls.append(time.time())
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                parts.append(text)
    end = time.perf_counter() - t0
    return StreamResult(
        "".join(parts), ttft if ttft is not None else end, end, usage, start_wall, tuple(walls)
    )
