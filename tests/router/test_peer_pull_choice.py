"""The router's choice of a prefix-pull source (pure, exact), and the workers' wire checks of
the grant and of ``kv_prefix_params``."""

from __future__ import annotations

import pytest

from tandem.engine.worker.protocol import BadRequest, parse_generate_request, parse_grant_request
from tandem.router.placement import PeerSource, choose_pull_source


def choose(chosen: int, *sources: tuple[str, int], usable: int = 20, min_tokens: int = 64):
    return choose_pull_source(
        chosen_cached_blocks=chosen,
        sources=[PeerSource(e, b) for e, b in sources],
        usable_blocks=usable,
        block_size=16,
        min_tokens=min_tokens,
    )


def test_the_longest_prefix_wins_when_it_is_enough_longer() -> None:
    assert choose(0, ("a", 3), ("b", 8), ("c", 5)) == PeerSource("b", 8)
    assert choose(4, ("a", 8)) == PeerSource("a", 8)  # (8 - 4) * 16 = 64: just enough
    assert choose(5, ("a", 8)) is None  # 48 more tokens < 64
    assert choose(0, ("a", 8), ("b", 8)) == PeerSource("a", 8)  # ties: the first
    assert choose(0) is None


def test_a_pull_never_covers_the_last_prompt_token_and_zero_turns_pulls_off() -> None:
    assert choose(0, ("a", 30), usable=10) == PeerSource("a", 10)
    assert choose(7, ("a", 30), usable=10) is None  # capped: 3 blocks more < 64 tokens
    assert choose(0, ("a", 30), min_tokens=0) is None


def grant_params() -> dict:
    return {"engine_id": "e", "side_channel": "tcp://127.0.0.1:5", "remote_request_id": "g",
            "block_ids": [1, 2], "num_tokens": 32, "first_token_id": 0, "lease_seconds": 5.0,
            "transfer_secret": "a" * 64, "block_checksums": [7, -9]}  # fmt: skip


def body(**fields: object) -> dict:
    return {"request_id": "r", "prompt_token_ids": [1] * 40, "sampling_params": {}, **fields}


def test_kv_prefix_params_travel_alone() -> None:
    assert parse_generate_request(body(kv_prefix_params=grant_params())).kv_prefix_params
    assert parse_generate_request(body()).kv_prefix_params is None
    for bad in (
        {"kv_prefix_params": "x"},
        {"kv_prefix_params": grant_params(), "remote_decode": True},
        {"kv_prefix_params": grant_params(), "resume_token_ids": [3]},
        {"kv_prefix_params": grant_params(), "kv_transfer_params": grant_params()},
        {"kv_prefix_params": grant_params(), "sampling_params": {"n": 2}},
    ):
        with pytest.raises(BadRequest):
            parse_generate_request(body(**bad))


def test_grant_requests_are_strict() -> None:
    assert parse_grant_request({"request_id": "g", "prompt_token_ids": [1, 2]}) == ("g", [1, 2])
    for bad in (
        [],
        {"request_id": "g"},
        {"request_id": "g", "prompt_token_ids": [1], "x": 1},
        {"request_id": "", "prompt_token_ids": [1]},
        {"request_id": "g", "prompt_token_ids": []},
        {"request_id": "g", "prompt_token_ids": [-1]},
        {"request_id": "g", "prompt_token_ids": [True]},
    ):
        with pytest.raises(BadRequest):
            parse_grant_request(bad)


def test_transfer_params_checksums_are_optional_and_checked() -> None:
    from tandem.engine.kv_connector import KVTransferParams

    p = KVTransferParams.from_dict(grant_params())
    assert p.block_checksums == (7, -9) and p.to_dict() == grant_params()
    plain = {k: v for k, v in grant_params().items() if k != "block_checksums"}
    q = KVTransferParams.from_dict(plain)
    assert q.block_checksums == () and q.to_dict() == plain  # a hand-off's wire is unchanged
    for sums in ([1], [1, "2"], "12", [1, 2**63]):
        with pytest.raises(ValueError, match="block_checksums"):
            KVTransferParams.from_dict({**plain, "block_checksums": sums})
