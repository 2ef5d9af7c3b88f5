"""plan_trace: a case's requests joined, simulator beside replays, and its summary."""

import pytest
from plan_trace import TraceRow, join, over, render
from replay_load import Measured

from tandem.planner.metrics import RequestTrace


def _trace(arrival: float, first: float | None, last: float | None, tokens: int) -> RequestTrace:
    return RequestTrace(arrival=arrival, num_prompt_tokens=8, max_tokens=tokens,
                        first_token=first, last_token=last, num_tokens=tokens)  # fmt: skip


def test_a_simulated_request_itl_is_the_mean_gap_after_its_first_token() -> None:
    assert _trace(1.0, 1.1, 1.4, 4).itl == pytest.approx(0.1)
    assert _trace(1.0, 1.1, 1.1, 1).itl is None
    assert _trace(1.0, None, None, 0).itl is None


def test_join_orders_the_traces_by_arrival_beside_each_replay() -> None:
    traces = [_trace(0.5, 0.6, 0.9, 4), _trace(0.0, 0.2, 0.5, 4)]
    a = [Measured(0.0, ttft=0.25, itl=0.2), Measured(0.5, ttft=0.1, itl=0.1)]
    b = [Measured(0.0, error="x"), Measured(0.5, ttft=0.3, itl=0.4)]
    rows = join(traces, [a, b])
    assert [r.arrival for r in rows] == [0.0, 0.5]
    assert rows[0].sim_ttft == pytest.approx(0.2) and rows[0].sim_itl == pytest.approx(0.1)
    assert rows[0].real == ((0.25, 0.2), (None, None))
    assert rows[1].real == ((0.1, 0.1), (0.3, 0.4))


def test_join_refuses_a_replay_of_another_length() -> None:
    with pytest.raises(ValueError, match="2 requests"):
        join([_trace(0.0, 0.1, 0.2, 2), _trace(1.0, 1.1, 1.2, 2)], [[Measured(0.0)]])


def test_over_counts_requests_past_a_quarter_above_the_simulator() -> None:
    rows = [
        TraceRow(0.0, 0.1, 0.004, ((0.1, 0.0051),)),  # 1.275x: over
        TraceRow(1.0, 0.1, 0.004, ((0.1, 0.005),)),  # 1.25x exactly: not over
        TraceRow(2.0, 0.1, None, ((0.1, 0.009),)),  # the simulator streamed one token
        TraceRow(3.0, 0.1, 0.004, ((None, None),)),  # the replay's request failed
    ]
    assert over(rows, 0) == 1


def test_render_lists_every_request_then_each_replay_summary() -> None:
    rows = [TraceRow(float(i), 0.1, 0.003, ((0.12, 0.006 if i == 0 else 0.003),))
            for i in range(20)]  # fmt: skip
    text = render(rows, [1.2]).splitlines()
    assert len(text) == 1 + 20 + 2
    assert text[1].split() == ["0.000", "|", "100.0", "3.00", "|", "120.0", "6.00"]
    assert text[-2] == "simulator: TTFT p90 100.00 ms, ITL p90 3.00 ms"
    assert text[-1].startswith("replay 1: TTFT p90 120.00 ms, ITL p90 ")
    assert text[-1].endswith("steps at 1.20x the simulator's, 1 of 20 requests over 1.25x its ITL")
