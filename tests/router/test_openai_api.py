"""The OpenAI API end to end: the official client against the router served on loopback, with
worker doubles behind it (one prefill, one decode unless stated)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from router_testlib import MODEL
from worker_double import CHAT_TEMPLATE, WorkerDouble


def expected(tokenizer: Any, prompt_ids: list[int], n: int, seed: int = 0) -> str:
    return tokenizer.decode([WorkerDouble.token_at(prompt_ids, k, seed) for k in range(n)])


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert text == f"<|user|>{content}\n<|assistant|>"  # the test template, applied by the router
    assert tokenizer.chat_template == CHAT_TEMPLATE
    return tokenizer.encode(text, add_special_tokens=False)


async def test_completion_text_usage_and_pd_flow(
    make_cluster: Any, tokenizer: Any, oai: Any
) -> None:
    c = await make_cluster()
    r = await oai(c.url).completions.create(model=MODEL, prompt="hello world", max_tokens=5)
    assert r.choices[0].text == "dlrow"
    assert r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 5, 16)
    prefill, decode = c.workers
    # One prefill with remote_decode, then decode with P's kv_transfer_params.
    assert [b["remote_decode"] for b in prefill.generate_calls] == [True]
    (d_call,) = decode.generate_calls
    assert d_call["kv_transfer_params"]["first_token_id"] == ord("d")
    assert d_call["prompt_token_ids"] == tokenizer.encode("hello world")
    assert c.metric("tandem_router_requests_total",
                    {"route": "/v1/completions", "code": "200"}) == 1  # fmt: skip
    assert (
        c.metric(
            "tandem_router_placements_total",
            {"pool": "prefill", "policy": "prefix-aware", "reason": "remote"},
        )
        == 1
    )


async def test_chat_completion_uses_chat_template(
    make_cluster: Any, tokenizer: Any, oai: Any
) -> None:
    c = await make_cluster()
    ids = chat_ids(tokenizer, "abc")
    r = await oai(c.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_completion_tokens=7
    )
    assert r.choices[0].message.content == expected(tokenizer, ids, 7)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 7


async def test_chat_stream_shapes_n2_include_usage(
    make_cluster: Any, tokenizer: Any, oai: Any
) -> None:
    c = await make_cluster()
    ids = chat_ids(tokenizer, "stream me")
    stream = await oai(c.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=6, n=2,
        seed=10, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [ch async for ch in stream]
    texts, finishes, seen_role = ["", ""], [None, None], [False, False]
    for ch in chunks[:-1]:
        assert ch.object == "chat.completion.chunk" and ch.usage is None
        (choice,) = ch.choices
        i = choice.index
        if choice.delta.role == "assistant":
            assert texts[i] == "" and not seen_role[i]  # the role delta comes first
            seen_role[i] = True
        assert seen_role[i]
        texts[i] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[i] = choice.finish_reason
    assert texts == [expected(tokenizer, ids, 6, 10), expected(tokenizer, ids, 6, 11)]
    assert finishes == ["length", "length"]
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 12)


async def test_raw_sse_ends_with_done(make_cluster: Any) -> None:
    c = await make_cluster()
    async with httpx.AsyncClient() as h:
        r = await h.post(
            f"{c.url}/v1/completions",
            json={"model": MODEL, "prompt": "xyz", "max_tokens": 2, "stream": True},
        )
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [p["choices"][0]["text"] for p in payloads] == ["z", "y", ""]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)


async def test_stop_string(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    r = await oai(c.url).completions.create(
        model=MODEL, prompt="abcdefgh", max_tokens=8, stop=["zz", "d"]
    )
    assert r.choices[0].text == "hgfe"
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", "d")
    assert c.workers[1].generate_calls[0]["sampling_params"]["stop"] == ["zz", "d"]


async def test_batch_prompts_and_token_id_prompts(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    r = await oai(c.url).completions.create(model=MODEL, prompt=["ab", "cde"], max_tokens=2,
                                               n=2)  # fmt: skip
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == ["ba", "ba", "ed", "ed"]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    r = await oai(c.url).completions.create(model=MODEL, prompt=[70, 71, 104], max_tokens=1)
    assert r.choices[0].text == "h"  # token id == byte value in the test tokenizer


async def test_max_tokens_one_finishes_at_prefill(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    r = await oai(c.url).completions.create(model=MODEL, prompt="qrs", max_tokens=1)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("s", "length")
    assert c.workers[1].generate_calls == []
    assert c.metric("tandem_time_to_first_token_seconds_count") == 1


async def test_logprobs_chat_and_completion(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    r = await oai(c.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == list(">|t")
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 for e in content)
    assert content[0].bytes == [ord(">")]
    r = await oai(c.url).completions.create(model=MODEL, prompt="ab", max_tokens=2, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["b", "a"] and lp.token_logprobs == [-0.25, -0.25]
    assert lp.top_logprobs == [{"b": -0.25}, {"a": -0.25}] and lp.text_offset == [0, 1]


async def test_models_health_metrics(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    models = await oai(c.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient() as h:
        health = (await h.get(f"{c.url}/health")).json()
        assert health == {"status": "ok", "workers": {"prefill": 1, "decode": 1, "colocated": 0}}
        await oai(c.url).completions.create(model=MODEL, prompt="abcdefgh", max_tokens=3)
        text = (await h.get(f"{c.url}/metrics")).text
    for name in (
        "tandem_router_requests_total",
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_inter_token_latency_seconds_bucket",
        "tandem_e2e_request_latency_seconds_bucket",
        "tandem_router_placements_total",
    ):
        assert name in text
    # P's token, then D's two: TTFT waits for D's first token, one ITL sample between D's tokens.
    assert c.metric("tandem_time_to_first_token_seconds_count") == 1
    assert c.metric("tandem_inter_token_latency_seconds_count") == 1
    assert c.metric("tandem_e2e_request_latency_seconds_count") == 1
    assert c.metric("tandem_router_prompt_tokens_total") == 8
    assert c.metric("tandem_router_generation_tokens_total") == 3


# -- bad input --------------------------------------------------------------------------------


async def _post(url: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient() as h:
        if isinstance(body, dict):
            return await h.post(url, json=body, headers=headers)
        return await h.post(url, content=body, headers=headers)


BAD_INPUTS: list[tuple[bytes | dict, int, str | None]] = [
    (b"{not json", 400, None),
    (b'"a string"', 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": 9}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "n": -1}, 400, "n"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 256}, 400, "prompt"),
    ({"model": MODEL, "prompt": [99999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    (b"{" + b" " * (2 * 1024 * 1024) + b"}", 413, None),
]


async def test_bad_input_gets_openai_error_and_server_keeps_serving(
    make_cluster: Any, oai: Any
) -> None:
    c = await make_cluster(max_body_bytes=1024 * 1024)
    for body, status, param in BAD_INPUTS:
        r = await _post(f"{c.url}/v1/completions", body)
        assert r.status_code == status, body
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["message"]
        good = await oai(c.url).completions.create(model=MODEL, prompt="ok", max_tokens=2)
        assert good.choices[0].text == "ko"
    assert c.workers[1].generate_calls[-1]["prompt_token_ids"] == [ord("o"), ord("k")]
    assert len(c.workers[0].generate_calls) == len(BAD_INPUTS)  # bad requests reached no worker
    assert c.metric("tandem_router_requests_total",
                    {"route": "/v1/completions", "code": "400"}) == 9  # fmt: skip


async def test_prompt_too_long_code_and_openai_exception(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    with pytest.raises(openai.BadRequestError) as e:
        await oai(c.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "y" * 400}]
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    # Past 8192 characters the prompt is tokenized on a worker thread: same answer.
    with pytest.raises(openai.BadRequestError) as e:
        await oai(c.url).completions.create(model=MODEL, prompt="z" * 9000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert "in the prompt, " in str(e.value)
    with pytest.raises(openai.NotFoundError):
        await oai(c.url).chat.completions.create(model="other", messages=[
            {"role": "user", "content": "hi"}])  # fmt: skip


async def test_api_key(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(api_keys=("sekret",))
    with pytest.raises(openai.AuthenticationError):
        await oai(c.url, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = await _post(f"{c.url}/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await oai(c.url, "wrong").models.list()
    ok = await oai(c.url, "sekret").completions.create(model=MODEL, prompt="xy", max_tokens=1)
    assert ok.choices[0].text == "y"
    assert c.metric("tandem_router_requests_total",
                    {"route": "/v1/completions", "code": "401"}) == 2  # fmt: skip


async def test_no_workers_is_503(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=())
    with pytest.raises(openai.InternalServerError) as e:
        await oai(c.url).completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 503


ODD_INPUTS: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": [{"role": "user", "content": None}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 5}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
    ("chat", {"messages": [{"role": "user", "content": "é中🙂"}], "max_tokens": 3}),
    ("chat", {"messages": [{"role": "user"}], "n": 3, "seed": 2**62}),
    ("completions", {"prompt": [[1, 2], [3]], "n": 2, "logprobs": 3, "max_tokens": 2}),
    ("completions", {"prompt": "x", "stop": ["🙂", "\n"], "max_tokens": 1}),
    ("completions", {"prompt": [2**70]}),
    ("completions", {"prompt": "x", "max_tokens": 10**12}),
    ("completions", {"prompt": "x", "stream_options": None, "stream": True, "max_tokens": 1}),
]


async def test_odd_inputs_are_never_a_server_error(make_cluster: Any) -> None:
    c = await make_cluster()
    for route, body in ODD_INPUTS:
        r = await _post(f"{c.url}/v1/{route if route == 'completions' else 'chat/completions'}",
                        {"model": MODEL, **body})  # fmt: skip
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"]
