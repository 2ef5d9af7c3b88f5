"""Streams that survive a decode failure (router/flow.py): a retry with the same KV before
decode's first token, a migration with the delivered tokens after it, the migration limit, and
the prefill's blocks freed when no decode takes them. Worker doubles; output checked exactly."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from router_testlib import MODEL, wait_for
from worker_double import Behaviour

PROMPT = "abcdefgh"  # the doubles answer the prompt reversed, one byte token at a time


async def stream_text(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, Any]:
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, usage, finish = [], None, None
    async for ch in stream:
        if ch.choices:
            text.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    return "".join(text), (usage, finish)


def decode_calls(c: Any) -> list[dict]:
    return [call for w in c.workers if w.role == "decode" for call in w.generate_calls]


async def test_decode_dying_mid_stream_migrates_with_the_delivered_tokens(make_cluster, oai):
    c = await make_cluster(roles=("prefill",))
    flaky = Behaviour(crash_after_tokens=2, faults_left=1)  # whichever decode goes first dies
    for _ in range(2):
        await c.add("decode", behaviour=flaky)
    text, (usage, finish) = await stream_text(oai(c.url), max_tokens=6)
    assert text == "hgfedc" and finish == "length"
    assert usage.completion_tokens == 6  # what the client received, nothing twice
    first, second = decode_calls(c)
    assert first["kv_transfer_params"] is not None and "resume_token_ids" not in first
    # Prefill's token and the failed decode's two, re-prefilled on the other decode.
    assert second["resume_token_ids"] == list(b"hgf") and second["kv_transfer_params"] is None
    assert c.metric("tandem_router_migrations_total", {"reason": "resume"}) == 1


async def test_decode_refusing_before_its_first_token_is_retried_with_the_same_kv(
    make_cluster, oai
):
    c = await make_cluster(roles=("prefill",))
    busy = Behaviour(fail_status=503, faults_left=1)
    for _ in range(2):
        await c.add("decode", behaviour=busy)
    r = await oai(c.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert r.choices[0].text == "hgfed" and r.usage.completion_tokens == 5
    first, second = decode_calls(c)
    assert second["kv_transfer_params"] == first["kv_transfer_params"] is not None
    assert c.metric("tandem_router_migrations_total", {"reason": "kv_retry"}) == 1
    assert c.workers[0].aborted == []  # the prefill's blocks went to the second decode


async def test_migration_limit_zero_fails_the_stream(make_cluster, oai):
    c = await make_cluster(roles=("prefill",), migration_limit=0)
    flaky = Behaviour(crash_after_tokens=1, faults_left=1)
    for _ in range(2):
        await c.add("decode", behaviour=flaky)
    with pytest.raises(openai.APIError, match="decode worker failed mid-stream"):
        await stream_text(oai(c.url), max_tokens=6)
    assert len(decode_calls(c)) == 1
    assert c.metric("tandem_router_migrations_total", {"reason": "resume"}) == 0


async def test_no_decode_takes_the_handoff_so_prefill_frees_it_at_once(make_cluster, oai):
    c = await make_cluster(roles=("prefill",))
    for _ in range(2):
        await c.add("decode", behaviour=Behaviour(fail_status=503))
    with pytest.raises(openai.APIStatusError) as err:
        await oai(c.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert err.value.status_code == 502
    p = c.workers[0]
    await wait_for(lambda: len(p.aborted) == 1, what="abort sent to prefill")
    assert p.aborted == [p.generate_calls[0]["request_id"]]


async def test_greedy_and_seeded_choices_migrate_with_n(make_cluster, oai):
    c = await make_cluster(roles=("prefill",))
    flaky = Behaviour(crash_after_tokens=1, faults_left=2)
    for _ in range(3):
        await c.add("decode", behaviour=flaky)
    r = await oai(c.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, seed=0)
    # Choice i is seeded seed + i: the doubles answer from a shifted start.
    assert sorted(ch.text for ch in r.choices) == ["gfed", "hgfe"]
    assert c.metric("tandem_router_migrations_total", {"reason": "resume"}) == 2
