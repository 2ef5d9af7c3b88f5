import json

import msgpack
import pytest

from tandem.engine.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.logprobs) == (None, 16, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (
        False,
        False,
        True,
    )
    assert not p.greedy


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_normalization() -> None:
    p = SamplingParams(stop="END", stop_token_ids=(3, 4), temperature=1, top_p=1)
    assert p.stop == ["END"]
    assert p.stop_token_ids == [3, 4]
    assert type(p.temperature) is float and type(p.top_p) is float
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 1e-6}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"top_k": 2}, False),
        ({"top_k": -1}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": True}, "n must be an integer, got bool"),
        ({"n": 1.0}, "n must be an integer, got float"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": "0.5"}, "temperature must be a number, got str '0.5'"),
        ({"temperature": True}, "temperature must be a number, got bool"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 (disabled), 0 (disabled) or >= 1, got -2"),
        ({"top_k": 2.0}, "top_k must be an integer, got float"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"seed": "7"}, "seed must be an integer, got str"),
        ({"seed": 2**63}, "seed must be <= 9223372036854775807"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 3.0}, "max_tokens must be an integer, got float"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"logprobs": 21}, "logprobs must be <= 20, got 21"),
        ({"stop": ""}, "stop[0] must be a non-empty string"),
        ({"stop": ["ok", 3]}, "stop[1] must be a string, got int"),
        ({"stop": 5}, "stop must be a string or a list of strings, got int"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids[1] must be >= 0, got -1"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0] must be an integer, got bool"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of ints, got str"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got int"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens must be a bool, got str"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_boundaries_are_accepted() -> None:
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        max_tokens=None,
        logprobs=20,
        seed=-(2**63),
    )
    assert p.logprobs == 20 and p.max_tokens is None


def test_validate_after_mutation() -> None:
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        p.validate()


def test_wire_roundtrip_json_and_msgpack() -> None:
    p = SamplingParams(
        n=2,
        temperature=0.5,
        top_k=5,
        seed=42,
        stop=["a", "bc"],
        stop_token_ids=[7],
        logprobs=3,
        max_tokens=None,
    )
    d = p.to_dict()
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(d))) == p
    d["stop"].append("zz")
    assert p.stop == ["a", "bc"]


def test_from_dict_defaults_missing_keys() -> None:
    assert SamplingParams.from_dict({"temperature": 0}) == SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"temprature": 0.5}, "unknown sampling parameter 'temprature'"),
        ({"max_tokens": "16"}, "max_tokens must be an integer"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings, got dict"),
        ({"top_k": None}, "top_k must be an integer, got NoneType"),
        (["temperature", 1.0], "sampling_params must be an object, got list"),
    ],
)
def test_from_dict_rejects_bad_input(d: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict(d)
    assert message in str(info.value)
