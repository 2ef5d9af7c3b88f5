"""Request validation: each bad parameter is a 400 naming it; good requests map to engine params."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.router.errors import OpenAIError
from tandem.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    validate,
)

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSGS, **kw}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(temperature="0.5"), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature=-0.1), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_p=1.5), "top_p"),
        (chat(n=0), "n"),
        (chat(n=True), "n"),
        (chat(n=129), "n"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=-3), "max_completion_tokens"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(frequency_penalty=-2.5), "frequency_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(top_k=-2), "top_k"),
        (chat(min_p=1.5), "min_p"),
        (chat(seed=1.5), "seed"),
        (chat(stop=[""]), "stop"),
        (chat(stop=["a"] * 17), "stop"),
        (chat(stop=5), "stop"),
        (chat(stop_token_ids=[-1]), "stop_token_ids"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
        (chat(messages=[{"role": "user", "content": 7}]), "messages.0.content"),
        (chat(messages="hello"), "messages"),
        ({"messages": MSGS}, "model"),
        ({"model": 3, "messages": MSGS}, "model"),
    ],
)
def test_bad_chat_parameter_is_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        validate(ChatCompletionRequest, body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": [[1], []]}, "prompt"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_bad_completion_parameter_is_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        validate(CompletionRequest, body)
    assert (info.value.status, info.value.param) == (400, param)


def test_missing_parameter_message() -> None:
    with pytest.raises(OpenAIError) as info:
        validate(CompletionRequest, {"prompt": "x"})
    assert info.value.message == "Missing required parameter: 'model'."
    assert info.value.code == "missing_required_parameter"


def test_parse_body_rejects_malformed_and_oversized() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_body(b"{not json", 100)
    assert (info.value.status, info.value.code) == (400, "invalid_json")
    with pytest.raises(OpenAIError) as info:
        parse_body(b"[1, 2]", 100)
    assert info.value.status == 400
    with pytest.raises(OpenAIError) as info:
        parse_body(b"{}" + b" " * 200, 100)
    assert info.value.status == 413
    assert parse_body(b'{"a": 1}', 100) == {"a": 1}


def test_chat_maps_to_engine_sampling_params() -> None:
    req = validate(
        ChatCompletionRequest,
        chat(temperature=0, top_p=0.9, seed=7, stop="END", max_completion_tokens=9,
             max_tokens=3, logprobs=True, top_logprobs=2, unknown_field="ignored"),
    )  # fmt: skip
    assert req.requested_max_tokens() == 9
    assert req.engine_logprobs() == 2
    assert req.to_sampling_dict(9, req.engine_logprobs()) == {
        "n": 1, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "seed": 7,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "max_tokens": 9, "stop": ["END"], "stop_token_ids": [], "ignore_eos": False,
        "logprobs": 2, "include_stop_str_in_output": False, "skip_special_tokens": True,
    }  # fmt: skip


def test_completion_prompt_forms() -> None:
    assert validate(CompletionRequest, {"model": "m", "prompt": "a"}).prompts() == ["a"]
    assert validate(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    two = validate(CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert two.prompts() == ["a", "b"]
    ids = validate(CompletionRequest, {"model": "m", "prompt": [[1], [2, 3]]})
    assert ids.prompts() == [[1], [2, 3]]


def test_sampling_dict_is_accepted_by_engine_sampling_params() -> None:
    """The wire form must round-trip through the engine's own SamplingParams.from_dict."""
    mod = pytest.importorskip("tandem.engine.sampling_params")
    req = validate(ChatCompletionRequest, chat(temperature=0.5, stop=["x"], seed=3))
    params = mod.SamplingParams.from_dict(req.to_sampling_dict(8, None))
    assert (params.temperature, params.max_tokens, params.stop, params.seed) == (0.5, 8, ["x"], 3)
