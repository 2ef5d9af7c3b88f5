"""Admission control and deadlines through the router (gate.py over admission.py): 429 with
Retry-After and an OpenAI error object, priority order, shedding, queue timeout, the request
deadline, and their metrics. Worker doubles."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from router_testlib import MODEL, wait_for


def body(prompt: str = "abcdef", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}


async def post(c: Any, b: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(f"{c.url}/v1/completions", json=b)


async def hold_one(c: Any, decode: Any) -> asyncio.Task[httpx.Response]:
    """A slow request that holds the only in-flight slot until it ends."""
    decode.behaviour.token_delay_s = 0.1
    task = asyncio.create_task(post(c, body("zzzz", max_tokens=6)))
    await wait_for(lambda: c.state.gate.inflight == 1, what="slot taken")
    return task


async def test_full_router_answers_429_with_retry_after_at_once(make_cluster) -> None:
    c = await make_cluster(roles=("decode",), max_inflight_requests=1, max_queued_requests=0)
    held = await hold_one(c, c.workers[0])
    r = await post(c, body())
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "queue_full") and err["message"]
    assert c.metric("tandem_router_rejections_total", {"reason": "queue_full"}) == 1
    assert (await held).status_code == 200
    assert (await post(c, body())).status_code == 200  # the slot came back
    assert c.state.gate.inflight == 0


async def test_queued_requests_run_by_priority_and_reach_the_worker_with_it(make_cluster) -> None:
    c = await make_cluster(roles=("decode",), max_inflight_requests=1, max_queued_requests=4)
    (d,) = c.workers
    held = await hold_one(c, d)
    low = asyncio.create_task(post(c, body("low", priority=5)))
    await wait_for(lambda: c.state.gate.depth == 1, what="low queued")
    high = asyncio.create_task(post(c, body("high", priority=-2)))
    await wait_for(lambda: c.state.gate.depth == 2, what="high queued")
    assert c.metric("tandem_router_queue_depth") == 2
    for t in (held, high, low):
        assert (await t).status_code == 200
    prompts = [bytes(call["prompt_token_ids"]).decode() for call in d.generate_calls]
    assert prompts == ["zzzz", "high", "low"]
    assert [call["priority"] for call in d.generate_calls] == [0, -2, 5]
    assert c.metric("tandem_router_queue_depth") == 0


async def test_full_queue_sheds_the_lowest_priority(make_cluster) -> None:
    c = await make_cluster(roles=("decode",), max_inflight_requests=1, max_queued_requests=1)
    held = await hold_one(c, c.workers[0])
    low = asyncio.create_task(post(c, body("low", priority=3)))
    await wait_for(lambda: c.state.gate.depth == 1, what="low queued")
    high = asyncio.create_task(post(c, body("hi", priority=0)))
    r_low = await low
    assert r_low.status_code == 429 and r_low.json()["error"]["code"] == "shed"
    assert (await high).status_code == 200 and (await held).status_code == 200
    assert c.metric("tandem_router_rejections_total", {"reason": "shed"}) == 1


async def test_queue_timeout_refuses_a_request_that_waited_too_long(make_cluster) -> None:
    c = await make_cluster(roles=("decode",), max_inflight_requests=1, queue_timeout_s=0.2)
    held = await hold_one(c, c.workers[0])
    r = await post(c, body())
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
    assert c.metric("tandem_router_rejections_total", {"reason": "queue_timeout"}) == 1
    assert (await held).status_code == 200


async def test_request_deadline_ends_slow_requests_and_aborts_the_worker(make_cluster) -> None:
    # The stream must get its headers (its first token, 0.3 s) well before the 1 s deadline even
    # on a loaded CI machine; 20 tokens take 6 s, so both requests hit it.
    c = await make_cluster(roles=("decode",), request_timeout_s=1.0)
    (d,) = c.workers
    d.behaviour.token_delay_s = 0.3
    r = await post(c, body(max_tokens=20))
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    await wait_for(lambda: len(d.aborted) == 1, what="abort after the deadline")
    async with httpx.AsyncClient(timeout=30) as h:
        async with h.stream(
            "POST", f"{c.url}/v1/completions", json=body(max_tokens=20, stream=True)
        ) as s:
            assert s.status_code == 200
            events = [line async for line in s.aiter_lines() if line.startswith("data: ")]
    assert '"request_timeout"' in events[-2] and events[-1] == "data: [DONE]"
    await wait_for(lambda: len(d.aborted) == 2, what="abort of the stream")
    assert c.metric("tandem_router_request_timeouts_total") == 2
    await wait_for(lambda: c.state.gate.inflight == 0, what="slots released")


async def test_default_limit_follows_the_decode_pools_batch_size(make_cluster) -> None:
    c = await make_cluster(roles=("decode", "decode"))
    assert c.state.inflight_limit() == 2 * 2 * 256  # doubles do not report max_num_seqs
