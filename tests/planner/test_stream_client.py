"""The serving stage's and the replay's streaming client, against a scripted router (httpx's
MockTransport): chunk times, the usage count, a refused request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.stream_client import StreamRejected, stream_completion, stream_times


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _client(status: int, content: bytes, seen: list[dict]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=content)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _run(coro):  # noqa: ANN001, ANN202 - a coroutine and its result
    return asyncio.run(coro)


def test_each_chunk_with_text_is_timed_and_usage_gives_the_tokens() -> None:
    held = {"choices": [{"text": ""}]}  # a token whose text is held back
    body = _sse({"choices": [{"text": "a"}]}, held, {"choices": [{"text": "bc"}]},
                {"choices": [], "usage": {"completion_tokens": 3}})  # fmt: skip
    seen: list[dict] = []

    async def go():  # noqa: ANN202
        async with _client(200, body, seen) as c:
            return await stream_completion(c, "http://r", "demo", [5, 6], 3)

    s = _run(go())
    assert s.tokens == 3 and len(s.times) == 2 and 0 <= s.times[0] <= s.times[1]
    assert seen == [{"model": "demo", "prompt": [5, 6], "max_tokens": 3, "temperature": 0.0,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}]  # fmt: skip


def test_stream_times_is_empty_unless_every_token_came() -> None:
    body = _sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 1}})

    async def go(max_tokens: int):  # noqa: ANN202
        async with _client(200, body, []) as c:
            return await stream_times(c, "http://r", "demo", [5], max_tokens)

    assert len(_run(go(1))) == 1
    assert _run(go(2)) == []


def test_a_refused_request_raises_with_its_status_and_body() -> None:
    async def go():  # noqa: ANN202
        async with _client(503, b'{"error": "overloaded"}', []) as c:
            return await stream_completion(c, "http://r", "demo", [5], 1)

    with pytest.raises(StreamRejected, match=r"HTTP 503: b'\{\"error\": \"overloaded\"\}'"):
        _run(go())
    assert issubclass(StreamRejected, httpx.HTTPError)
