"""SLOs, attainment and goodput of the P/D benchmark: exact values on small inputs."""

import math

import pytest
from pd_bench.latency import bucket_delta, cdf, histogram_quantile, percentile
from pd_bench.slo import (
    ItlProfile,
    Req,
    TtftProfile,
    Unloaded,
    attainment,
    goodput,
    goodput_interpolated,
    make_slo,
    unloaded,
)


def req(prompt: int, ttft: float | None, itl: float | None, done: bool = True) -> Req:
    return Req(0.0, prompt, 16, ttft, itl, 1.0 if done else None, done)


def flat(ms: float) -> TtftProfile:
    return TtftProfile(((1, ms),))


def test_ttft_profile_interpolates_and_never_falls() -> None:
    p = TtftProfile.of([(1000, 500.0), (100, 60.0), (500, 40.0), (100, 50.0)])
    # Sorted by length; a shorter prompt's higher TTFT carries forward; duplicates keep the max.
    assert p.points == ((100, 60.0), (500, 60.0), (1000, 500.0))
    assert p.at(32) == 60.0  # flat below the shortest
    assert p.at(750) == 280.0
    assert p.at(4000) == 500.0  # flat above the longest
    with pytest.raises(ValueError):
        TtftProfile.of([])


def test_itl_profile_is_a_least_squares_line_that_never_falls() -> None:
    # (0, 5), (100, 7), (200, 9): exactly 5 + 0.02 per token.
    p = ItlProfile.fit([(0, 5.0), (100, 7.0), (200, 9.0)])
    assert p == ItlProfile(5.0, 0.02)
    assert p.at(2000) == 45.0
    # Noise: (0, 6), (100, 4), (200, 7), (300, 5) has slope -0.001 -> clamped: the mean, 5.5.
    assert ItlProfile.fit([(0, 6.0), (100, 4.0), (200, 7.0), (300, 5.0)]) == ItlProfile(5.5, 0.0)
    assert ItlProfile.fit([(32, 4.0), (32, 6.0)]) == ItlProfile(5.0, 0.0)  # one length: flat
    with pytest.raises(ValueError):
        ItlProfile.fit([])


def test_unloaded_profiles_completed_requests_only() -> None:
    u = unloaded([req(100, 20, 5), req(300, 60, 7), req(200, None, None, done=False)])
    assert u.ttft.points == ((100, 20), (300, 60))
    assert u.itl == ItlProfile(4.0, 0.01)
    assert u.itl_ms == 6.0
    assert u.requests == 2
    with pytest.raises(ValueError):
        unloaded([req(100, 20, 5)])


def test_slo_uses_the_best_deployment_per_prompt_length() -> None:
    # ITL: one deployment flat at 8 ms, the other 4 ms + 0.02 per token: the envelope is the
    # second up to 200 tokens, the first beyond.
    fast_short = Unloaded(TtftProfile(((0, 10.0), (100, 110.0), (200, 210.0))),
                          ItlProfile(8.0, 0.0), 8.0, 4)  # fmt: skip
    fast_long = Unloaded(TtftProfile(((0, 60.0), (200, 160.0))), ItlProfile(4.0, 0.02), 5.0, 4)
    slo = make_slo([fast_short, fast_long], ttft_x=2.0, itl_x=1.5)
    assert slo.ttft_ms(50) == 2.0 * 60.0
    assert slo.ttft_ms(200) == 2.0 * 160.0
    assert slo.itl_limit_ms(50) == 1.5 * 5.0
    assert slo.itl_limit_ms(1000) == 1.5 * 8.0
    assert slo.meets(req(50, 120.0, 7.5))
    assert not slo.meets(req(50, 120.1, 1.0))
    assert not slo.meets(req(50, 1.0, 7.6))
    assert slo.meets(req(1000, 300.0, 12.0))  # a long context's ITL is judged at its length
    assert not slo.meets(req(1000, 300.0, 12.1))
    assert slo.meets(req(50, 1.0, None))  # one output token: no ITL to judge
    assert not slo.meets(req(50, None, None, done=False))
    with pytest.raises(ValueError):
        make_slo([], 1, 1)


def test_attainment_counts_unfinished_requests_as_misses() -> None:
    slo = make_slo([Unloaded(flat(10.0), ItlProfile(10.0, 0.0), 10.0, 2)], 1.0, 1.0)
    reqs = [req(1, 5, 5), req(1, 5, 5), req(1, 50, 5), req(1, None, None, done=False)]
    assert attainment(reqs, slo) == 0.5
    assert attainment([], slo) == 0.0


def test_goodput_highest_passing_rate_below_the_first_failure() -> None:
    pts = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.5), (4.0, 0.92)]
    assert goodput(pts, 0.9) == 2.0  # the pass at 4 above a failure at 3 is noise
    assert goodput([(1.0, 0.5)], 0.9) == 0.0
    # Crossing between 2 (0.95) and 3 (0.5): 2 + (0.95 - 0.9) / 0.45.
    assert goodput_interpolated(pts, 0.9) == pytest.approx(2 + 0.05 / 0.45)
    assert goodput_interpolated([(1.0, 0.99), (2.0, 0.91)], 0.9) == 2.0
    assert goodput_interpolated([(1.0, 0.2)], 0.9) == 0.0


def test_percentiles_histogram_quantiles_and_cdf() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))
    buckets = [(0.01, 10.0), (0.1, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, buckets) == 0.01
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.055)
    assert histogram_quantile(1.0, [(0.01, 1.0), (math.inf, 2.0)]) == 0.01
    assert math.isnan(histogram_quantile(0.5, [(math.inf, 0.0)]))
    assert bucket_delta([(0.01, 5.0), (math.inf, 9.0)], [(0.01, 2.0), (math.inf, 3.0)]) == [
        (0.01, 3.0), (math.inf, 6.0),
    ]  # fmt: skip
    assert cdf([3, 1, 2]) == ([1, 2, 3], [1 / 3, 2 / 3, 1.0])
    assert cdf([]) == ([], [])


def test_the_default_model_holds_every_workloads_longest_request() -> None:
    from pd_bench.workloads import MODEL_CONTEXT, longest_request

    # prefill-heavy: 2048-token prompts + 256-token outputs; at 2048 positions they were refused.
    assert longest_request() == 2048 + 256
    assert MODEL_CONTEXT >= longest_request() + 64  # the chat template's tokens on top
