"""Placement scoring and policies, and the conditional-disaggregation decision (table-driven)."""

from __future__ import annotations

import pytest

from tandem.router.placement import (
    Candidate,
    Placer,
    Policy,
    PrefillMode,
    Weights,
    decide_prefill,
    load_of,
    score_of,
)


def cand(eid: str, overlap: int = 0, blocks: int = 10, running: int = 0, waiting: int = 0,
         kv: float = 0.0, inflight: int = 0) -> Candidate:  # fmt: skip
    return Candidate(eid, overlap, blocks, running, waiting, kv, inflight)


def test_score_formula_exact() -> None:
    w = Weights(prefix_weight=1.0, load_weight=1.0, load_scale=4.0)
    c = cand("a", overlap=5, blocks=10, running=2, waiting=1, kv=0.25, inflight=1)
    assert load_of(c, w) == 0.25 + (3 + 1) / 4
    assert score_of(c, w) == 0.5 - 1.25
    # Router in-flight count wins over a lagging heartbeat.
    assert load_of(cand("b", inflight=6), w) == 1.5


def test_long_prompt_counts_cached_blocks_in_units() -> None:
    w = Weights(prefix_unit_blocks=16)
    # Up to 16 blocks the prefix term is the cached fraction; beyond, cached blocks / 16.
    assert score_of(cand("a", overlap=5, blocks=10), w) == 0.5
    assert score_of(cand("a", overlap=40, blocks=100, running=2), w) == 40 / 16 - 0.5
    with pytest.raises(ValueError, match="prefix_unit_blocks"):
        Weights(prefix_unit_blocks=0)


@pytest.mark.parametrize(
    ("cands", "expected", "reason"),
    [
        # A long cached history outweighs a few more queued requests...
        ([cand("a", overlap=64, blocks=100, running=6), cand("b")], "a", "prefix_hit"),
        # ...but not an unbounded pile-up.
        ([cand("a", overlap=100, blocks=100, running=30), cand("b")], "b", "load"),
    ],
)
def test_long_prompt_choice(cands: list[Candidate], expected: str, reason: str) -> None:
    choice = Placer(Policy.PREFIX_AWARE).choose("decode", cands)
    assert (choice.engine_id, choice.reason) == (expected, reason)


@pytest.mark.parametrize(
    ("cands", "expected", "reason"),
    [
        ([cand("a"), cand("b", overlap=8)], "b", "prefix_hit"),
        ([cand("a", overlap=8, running=8), cand("b")], "b", "load"),
        ([cand("a", overlap=10, running=3), cand("b")], "a", "prefix_hit"),
        ([cand("a", kv=0.9), cand("b", kv=0.1)], "b", "load"),
        ([cand("a", waiting=1), cand("b", running=1)], "b", "load"),
        (
            [cand("a", overlap=2, blocks=4, running=1), cand("b", overlap=4, blocks=4, running=4)],
            "a",
            "prefix_hit",
        ),
    ],
)
def test_prefix_aware_choice(cands: list[Candidate], expected: str, reason: str) -> None:
    choice = Placer(Policy.PREFIX_AWARE).choose("decode", cands)
    assert (choice.engine_id, choice.reason) == (expected, reason)


def test_ties_rotate() -> None:
    placer = Placer(Policy.PREFIX_AWARE)
    picks = [placer.choose("decode", [cand("a"), cand("b"), cand("c")]).engine_id
             for _ in range(6)]  # fmt: skip
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_load_ignores_prefix() -> None:
    choice = Placer(Policy.LEAST_LOAD).choose("p", [cand("a", overlap=10, running=1), cand("b")])
    assert (choice.engine_id, choice.reason) == ("b", "least_load")


def test_round_robin_per_pool() -> None:
    placer = Placer(Policy.ROUND_ROBIN)
    cs = [cand("a", running=9), cand("b")]
    assert [placer.choose("p", cs).engine_id for _ in range(3)] == ["a", "b", "a"]
    assert placer.choose("d", cs).engine_id == "a"
    assert placer.choose("d", cs).reason == "round_robin"


def test_policy_parse() -> None:
    assert Policy.parse("prefix-aware") is Policy.PREFIX_AWARE
    assert Policy.parse("least-load") is Policy.LEAST_LOAD
    assert Policy.ROUND_ROBIN.label == "round-robin"
    with pytest.raises(ValueError, match="unknown placement policy"):
        Policy.parse("random")


@pytest.mark.parametrize(
    ("prompt", "cached", "threshold", "colocated", "p_avail", "mode", "reason"),
    [
        (100, 0, 0, False, True, PrefillMode.REMOTE, "remote"),
        (100, 0, 0, True, True, PrefillMode.LOCAL, "colocated"),
        (100, 0, 0, False, False, PrefillMode.LOCAL, "local_no_prefill_worker"),
        (100, 0, 50, False, True, PrefillMode.REMOTE, "remote"),
        (100, 60, 50, False, True, PrefillMode.LOCAL, "local_below_threshold"),
        (100, 50, 50, False, True, PrefillMode.REMOTE, "remote"),
        (10, 0, 11, False, True, PrefillMode.LOCAL, "local_below_threshold"),
    ],
)
def test_decide_prefill(prompt: int, cached: int, threshold: int, colocated: bool,
                        p_avail: bool, mode: PrefillMode, reason: str) -> None:  # fmt: skip
    d = decide_prefill(prompt_tokens=prompt, decode_cached_tokens=cached,
                       threshold_tokens=threshold, decode_is_colocated=colocated,
                       prefill_available=p_avail)  # fmt: skip
    assert (d.mode, d.reason) == (mode, reason)


@pytest.mark.parametrize(
    ("min_queue", "limit", "mode", "reason"),
    [
        (0, 0, PrefillMode.REMOTE, "remote"),
        (50, 0, PrefillMode.REMOTE, "remote"),  # 0 disables the overload rule
        (3, 4, PrefillMode.REMOTE, "remote"),
        (4, 4, PrefillMode.LOCAL, "local_prefill_overloaded"),
        (9, 4, PrefillMode.LOCAL, "local_prefill_overloaded"),
    ],
)
def test_decide_prefill_overloaded_pool(
    min_queue: int, limit: int, mode: PrefillMode, reason: str
) -> None:
    d = decide_prefill(
        prompt_tokens=100,
        decode_cached_tokens=0,
        threshold_tokens=0,
        decode_is_colocated=False,
        prefill_available=True,
        prefill_min_queue=min_queue,
        overload_queue=limit,
    )
    assert (d.mode, d.reason) == (mode, reason)


def test_decide_prefill_incompatible_pool_prefills_locally() -> None:
    common = dict(prompt_tokens=500, decode_cached_tokens=0, threshold_tokens=0,
                  decode_is_colocated=False)  # fmt: skip
    d = decide_prefill(**common, prefill_available=False, prefill_incompatible=True)
    assert (d.mode, d.reason) == (PrefillMode.LOCAL, "incompatible")
    d = decide_prefill(**common, prefill_available=False)
    assert (d.mode, d.reason) == (PrefillMode.LOCAL, "local_no_prefill_worker")
    d = decide_prefill(**common, prefill_available=True)
    assert d.mode is PrefillMode.REMOTE
