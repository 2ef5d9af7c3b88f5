"""``benchmarks/handoff_gap.py``'s arithmetic: nearest-rank quantiles and the split of each
request's stream into its first token, its first gap (1P1D: the hand-off) and the gaps after."""

from __future__ import annotations

import pytest
from handoff_gap import quantiles, summarize
from replay_load import Measured


def test_quantiles_are_nearest_rank_in_ms() -> None:
    q = quantiles([i / 1000 for i in range(1, 11)])  # 1..10 ms
    assert q == pytest.approx({"p10": 2.0, "p50": 6.0, "p90": 10.0, "p99": 10.0, "mean": 5.5})


def test_each_request_splits_into_first_token_first_gap_and_later_gaps() -> None:
    # 5 tokens: first at 10 ms, second at 16 ms (the hand-off), last at 22 ms.
    a = Measured(0.0, ttft=0.010, itl=0.003, e2e=0.022, first_gap=0.006, tokens=5)
    b = Measured(0.1, ttft=0.020, itl=0.004, e2e=0.036, first_gap=0.010, tokens=5)
    failed = Measured(0.2, error="HTTP 503")
    s = summarize([a, b, failed])
    assert (s["requests"], s["failed"]) == (3, 1)
    assert s["first_gap"] == pytest.approx({"p10": 6.0, "p50": 10.0, "p90": 10.0, "p99": 10.0,
                                            "mean": 8.0})  # fmt: skip
    assert s["later_gap"]["mean"] == pytest.approx((2.0 + 2.0) / 2)  # (22-10-6)/3, (36-20-10)/3
    assert s["ttft"]["p50"] == pytest.approx(20.0)


def test_nothing_to_time_is_said_plainly() -> None:
    with pytest.raises(SystemExit, match="three tokens"):
        summarize([Measured(0.0, ttft=0.01, e2e=0.01, tokens=1)])
