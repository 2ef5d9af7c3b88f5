"""Request limits at the router, each at its boundary: accepted at the limit, refused (400, the
field named, nothing sent to a worker) one past it. The router serves worker doubles."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from router_testlib import MODEL

from tandem.engine.request_limits import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from tandem.router.protocol import MAX_TEMPLATE_KWARG_CHARS, MAX_TEMPLATE_KWARGS


async def _post(url: str, body: dict[str, Any] | bytes, path: str = "/v1/completions") -> Any:
    async with httpx.AsyncClient(timeout=30) as h:
        if isinstance(body, bytes):
            return await h.post(f"{url}{path}", content=body,
                                headers={"Content-Type": "application/json"})  # fmt: skip
        return await h.post(f"{url}{path}", json=body)


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "ab", "max_tokens": 1, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 1,
            **kw}  # fmt: skip


# (accepted at the limit, refused one past it, the field the refusal names)
BOUNDARIES = [
    ("n", completion(n=MAX_N), completion(n=MAX_N + 1), "n"),
    (
        "prompts x n",
        completion(prompt=["ab", "cd"], n=MAX_CHOICES // 2),
        completion(prompt=["ab", "cd", "ef"], n=(MAX_CHOICES + 1) // 3),  # 3 x 43 = 129
        "prompt",
    ),
    (
        "logprobs",
        completion(logprobs=MAX_LOGPROBS),
        completion(logprobs=MAX_LOGPROBS + 1),
        "logprobs",
    ),
    (
        "top_logprobs",
        chat(logprobs=True, top_logprobs=MAX_LOGPROBS),
        chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1),
        "top_logprobs",
    ),
    (
        "stop strings",
        completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
        completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
        "stop",
    ),
    (
        "stop bytes",
        completion(stop=["é" * (MAX_STOP_STRING_BYTES // 2)]),  # 2 bytes each in UTF-8
        completion(stop=["é" * (MAX_STOP_STRING_BYTES // 2) + "x"]),
        "stop",
    ),
    (
        "stop_token_ids",
        completion(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS),
        completion(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
        "stop_token_ids",
    ),
    (
        "max_tokens vs context",
        completion(prompt="ab", max_tokens=254),  # the doubles' max_model_len is 256
        completion(prompt="ab", max_tokens=255),
        "prompt",
    ),
    (
        "template kwargs count",
        chat(chat_template_kwargs={f"k{i}": True for i in range(MAX_TEMPLATE_KWARGS)}),
        chat(chat_template_kwargs={f"k{i}": True for i in range(MAX_TEMPLATE_KWARGS + 1)}),
        "chat_template_kwargs",
    ),
    (
        "template kwarg length",
        chat(chat_template_kwargs={"style": "x" * MAX_TEMPLATE_KWARG_CHARS}),
        chat(chat_template_kwargs={"style": "x" * (MAX_TEMPLATE_KWARG_CHARS + 1)}),
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize(
    ("what", "ok", "past", "param"), BOUNDARIES, ids=[b[0] for b in BOUNDARIES]
)
async def test_limit_boundary(
    make_cluster: Any, what: str, ok: dict, past: dict, param: str
) -> None:
    # 128 sub-requests share the test's event loop with the doubles' heartbeats: a roomier
    # heartbeat timeout than the fixture's 0.6 s keeps a loaded machine from expiring them.
    c = await make_cluster(heartbeat_timeout_s=5.0)
    path = "/v1/chat/completions" if "messages" in ok else "/v1/completions"
    r = await _post(c.url, ok, path)
    assert r.status_code == 200, (what, r.text)
    calls = sum(len(w.generate_calls) for w in c.workers)
    r = await _post(c.url, past, path)
    assert r.status_code == 400, (what, r.text)
    assert r.json()["error"]["param"] == param
    assert sum(len(w.generate_calls) for w in c.workers) == calls  # refused before any work


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "tools", "return_dict", "_private"])
async def test_template_kwargs_that_change_the_rendering_are_refused(
    make_cluster: Any, key: str
) -> None:
    c = await make_cluster(roles=("decode",))
    r = await _post(c.url, chat(chat_template_kwargs={key: "{{ 1 }}"}), "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert key in r.json()["error"]["message"]


async def test_body_size_boundary(make_cluster: Any) -> None:
    limit = 64 * 1024
    c = await make_cluster(max_body_bytes=limit, roles=("decode",))
    head = json.dumps(completion()).encode()
    at_limit = head[:-1] + b" " * (limit - len(head)) + b"}"
    assert len(at_limit) == limit
    assert (await _post(c.url, at_limit)).status_code == 200
    r = await _post(c.url, at_limit[:-1] + b" }")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


class SlowEncoder:
    """Wraps the real encoder; chat rendering takes ``delay`` seconds (a pathological
    template), on whatever thread it runs."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay

    def encode_chat(self, *args: Any) -> list[int]:
        time.sleep(self.delay)
        return self._inner.encode_chat(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_slow_template_times_out_without_stalling_the_loop(make_cluster: Any) -> None:
    c = await make_cluster(roles=("decode",), template_timeout_s=0.3)
    c.state.encoder = SlowEncoder(c.state.encoder, 2.0)
    async with httpx.AsyncClient(timeout=10) as h:
        slow = asyncio.create_task(h.post(f"{c.url}/v1/chat/completions", json=chat()))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        health = await h.get(f"{c.url}/health")  # the event loop is free meanwhile
        assert health.status_code == 200 and time.monotonic() - started < 0.25
        r = await slow
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_complex"
    c.state.encoder.delay = 0.0
    ok = await _post(c.url, chat(), "/v1/chat/completions")
    assert ok.status_code == 200


async def test_prefix_index_is_bounded_by_the_router_not_the_worker_claim(
    make_cluster: Any,
) -> None:
    c = await make_cluster(roles=(), index_blocks_per_worker=3)
    w = await c.add("decode", num_blocks=1 << 20)  # claims a million blocks
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(f"{c.url}/v1/completions", json=completion(prompt="abcdefghijklmnopqrst"))
    assert r.status_code == 200
    from router_testlib import wait_for

    await wait_for(lambda: c.state.index.size(w.engine_id) == 3, what="index at its cap")
    assert len(w.stored) == 5  # the worker holds five 4-token blocks; the index keeps three
