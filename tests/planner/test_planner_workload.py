"""Workload generation: deterministic for a seed, the asked rate, lengths and shared prefixes."""

from __future__ import annotations

import pytest
from sim_profiles import DEMO_TOKENS

from tandem.planner.workload import Arrival, Lengths, Spread, Workload, generate


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    w = Workload(rate=10, isl=Lengths(50, 0.5), osl=Lengths(20, 0.5), num_requests=50)
    a = generate(w, DEMO_TOKENS, seed=1, max_model_len=256)
    assert a == generate(w, DEMO_TOKENS, seed=1, max_model_len=256)
    assert a != generate(w, DEMO_TOKENS, seed=2, max_model_len=256)
    assert all(25 <= len(r.prompt_token_ids) <= 75 and 10 <= r.max_tokens <= 30 for r in a)
    assert all(set(r.prompt_token_ids) <= set(DEMO_TOKENS) for r in a)


def test_constant_arrivals_are_evenly_spaced_and_poisson_has_the_rate() -> None:
    const = Workload(rate=4, isl=Lengths(8), osl=Lengths(4), num_requests=5,
                     arrival=Arrival.CONSTANT)  # fmt: skip
    assert [r.arrival for r in generate(const, DEMO_TOKENS, 0, 64)] == [0, 0.25, 0.5, 0.75, 1.0]
    for arrival in (Arrival.POISSON, Arrival.GAMMA):
        w = Workload(rate=20, isl=Lengths(8), osl=Lengths(4), num_requests=4000, arrival=arrival)
        reqs = generate(w, DEMO_TOKENS, 3, 64)
        assert reqs[-1].arrival / (len(reqs) - 1) == pytest.approx(1 / 20, rel=0.08)


def test_prefix_share_puts_one_of_the_group_prefixes_in_front() -> None:
    w = Workload(rate=1, isl=Lengths(100), osl=Lengths(4), num_requests=40, prefix_share=0.4,
                 prefix_groups=2)  # fmt: skip
    reqs = generate(w, DEMO_TOKENS, 0, 256)
    heads = {r.prompt_token_ids[:40] for r in reqs}
    assert len(heads) == 2
    assert len({r.prompt_token_ids[40:] for r in reqs}) == 40


def test_lengths_fit_the_model() -> None:
    w = Workload(rate=1, isl=Lengths(300), osl=Lengths(50), num_requests=3)
    for r in generate(w, DEMO_TOKENS, 0, 256):
        assert len(r.prompt_token_ids) == 255 and r.max_tokens == 1
    assert Lengths(10, 0.5, Spread.FIXED).draw(__import__("random").Random(0)) == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0}, "rate"),
        ({"num_requests": 0}, "num_requests"),
        ({"prefix_share": 1.0}, "prefix_share"),
        ({"prefix_groups": 0}, "prefix_groups"),
    ],
)
def test_bad_workloads_are_refused(kwargs: dict, message: str) -> None:
    base = {"rate": 1.0, "isl": Lengths(8), "osl": Lengths(4)}
    with pytest.raises(ValueError, match=message):
        Workload(**{**base, **kwargs})
    with pytest.raises(ValueError, match="mean length"):
        Lengths(0)
