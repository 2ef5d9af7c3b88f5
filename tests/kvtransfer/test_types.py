"""KVLayout, KVTransferParams validation and layout comparison."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kv_connector import KVTransferParams
from tandem.engine.kv_layout import KVLayout, layout_mismatch

LAYOUT = KVLayout(4, 2, 64, 16, "float32", 64)
GOOD = {
    "engine_id": "e1",
    "side_channel": "tcp://127.0.0.1:5555",
    "remote_request_id": "r1",
    "block_ids": [3, 1, 2],
    "num_tokens": 40,
    "first_token_id": 7,
    "lease_seconds": 10.0,
    "transfer_secret": "0f" * 32,
}


def test_layout_geometry() -> None:
    assert LAYOUT.block_bytes == 2 * 4 * 16 * 2 * 64 * 4
    kv = torch.zeros(LAYOUT.shape)
    assert KVLayout.from_kv_cache(kv) == LAYOUT
    assert kv[0].numel() * kv.element_size() == LAYOUT.block_bytes
    LAYOUT.check_kv_cache(kv)
    with pytest.raises(ValueError):
        LAYOUT.check_kv_cache(kv.to(torch.float16))
    with pytest.raises(ValueError):
        KVLayout(4, 2, 64, 16, "int8", 64)
    with pytest.raises(ValueError):
        KVLayout(4, 2, 64, 0, "float32", 64)


def test_layout_mismatch_names_each_field() -> None:
    assert layout_mismatch(LAYOUT, KVLayout(4, 2, 64, 16, "float32", 999)) is None
    msg = layout_mismatch(LAYOUT, KVLayout(4, 2, 64, 32, "bfloat16", 64))
    assert msg == (
        "KV layout mismatch: block_size (local 16, remote 32), "
        "dtype (local 'float32', remote 'bfloat16')"
    )


def test_params_round_trip() -> None:
    params = KVTransferParams.from_dict(GOOD)
    assert params.block_ids == (3, 1, 2)
    assert KVTransferParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"side_channel": "http://x:1"}, "side_channel"),
        ({"side_channel": "tcp://host"}, "side_channel"),
        ({"block_ids": [1, 1]}, "block_ids"),
        ({"block_ids": [1, -1]}, "block_ids"),
        ({"block_ids": [True]}, "block_ids"),
        ({"block_ids": "12"}, "block_ids"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"first_token_id": 1.0}, "first_token_id"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"lease_seconds": float("nan")}, "lease_seconds"),
        ({"extra": 1}, "unexpected"),
        ({"transfer_secret": "0f" * 31}, "transfer_secret"),
        ({"transfer_secret": "0F" * 32}, "transfer_secret"),
        ({"transfer_secret": 5}, "transfer_secret"),
    ],
)
def test_params_rejects(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVTransferParams.from_dict({**GOOD, **change})
    with pytest.raises(ValueError, match="missing"):
        KVTransferParams.from_dict({k: v for k, v in GOOD.items() if k != "num_tokens"})


def test_params_repr_hides_the_transfer_secret() -> None:
    params = KVTransferParams.from_dict(GOOD)
    assert GOOD["transfer_secret"] not in repr(params)
    assert params.to_dict()["transfer_secret"] == GOOD["transfer_secret"]
