"""Pure parts of the worker service: request validation and the KV event wire format."""

from __future__ import annotations

import msgpack
import pytest

from tandem.engine.kv_events import KVEvent, KVEventKind, encode_events
from tandem.engine.worker.protocol import BadRequest, parse_generate_request


def test_valid_request_parses() -> None:
    req = parse_generate_request(
        {
            "request_id": "r",
            "prompt_token_ids": [1, 2],
            "sampling_params": {"max_tokens": 3},
            "remote_decode": True,
        }
    )
    assert req.prompt_token_ids == [1, 2] and req.params.max_tokens == 3 and req.remote_decode


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "r", "prompt_token_ids": [1, True]}, "prompt_token_ids"),
        ({"request_id": "r", "prompt_token_ids": [-1]}, "prompt_token_ids"),
        (
            {"request_id": "r", "prompt_token_ids": [1], "sampling_params": {"n": 0}},
            "sampling_params",
        ),
        ({"request_id": "r", "prompt_token_ids": [1], "remote_decode": "yes"}, "remote_decode"),
        (
            {"request_id": "r", "prompt_token_ids": [1], "kv_transfer_params": [1]},
            "kv_transfer_params",
        ),
        (
            {
                "request_id": "r",
                "prompt_token_ids": [1],
                "sampling_params": {"n": 2},
                "remote_decode": True,
            },
            "n",
        ),
        ({"request_id": "r", "prompt_token_ids": [1], "extra": 1}, "extra"),
    ],
)
def test_malformed_requests_name_the_field(body: object, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_generate_request(body)
    assert info.value.param == param


def test_kv_events_wire_format_is_exact() -> None:
    h1, h2 = b"\x01" * 16, b"\x02" * 16
    payload = encode_events(
        "eng",
        7,
        [
            KVEvent(KVEventKind.STORED, (h1, h2)),
            KVEvent(KVEventKind.REMOVED, (h1,)),
            KVEvent(KVEventKind.CLEARED),
        ],
    )
    assert msgpack.unpackb(payload) == {
        "v": 1,
        "engine_id": "eng",
        "seq": 7,
        "events": [["stored", [h1, h2]], ["removed", [h1]], ["cleared"]],
    }


@pytest.mark.parametrize(
    ("ok", "past", "param"),
    [
        ({"n": 128}, {"n": 129}, "n"),
        ({"n": 128}, {"n": 10**9}, "n"),  # refused before any per-choice work
        ({"stop": ["s"] * 16}, {"stop": ["s"] * 17}, "stop"),
        ({"stop": ["x" * 1024]}, {"stop": ["x" * 1025]}, "stop"),
        ({"stop": "é" * 512}, {"stop": "é" * 513}, "stop"),
        ({"stop_token_ids": [1] * 256}, {"stop_token_ids": [1] * 257}, "stop_token_ids"),
        ({"logprobs": 20}, {"logprobs": 21}, "sampling_params"),
    ],
)
def test_worker_rechecks_the_router_limits(ok: dict, past: dict, param: str) -> None:
    """Defence in depth: a request that reached a worker without the router gets the same
    bounds, each accepted at the limit and refused one past it."""
    base = {"request_id": "r", "prompt_token_ids": [1, 2]}
    assert parse_generate_request({**base, "sampling_params": ok}).params is not None
    with pytest.raises(BadRequest) as e:
        parse_generate_request({**base, "sampling_params": past})
    assert e.value.param == param
