"""wake_sweep: CPU per token from per-request figures, repeats averaged, the table with each
width's implied share, and the staggered sender's lanes."""

import asyncio
import json

import httpx
import pytest
from wake_sweep import Width, mean_widths, per_token, render, staggered

from tandem.calibrate import CLIENT, OSL
from tandem.up_config import ROUTER


def test_per_token_is_the_further_tokens_share_of_a_long_request() -> None:
    long = {ROUTER: 0.002 + (OSL - 1) * 100e-6, CLIENT: 0.001}
    short = {ROUTER: 0.002, CLIENT: 0.0015}
    got = per_token(long, short)
    assert got[ROUTER] == pytest.approx(100e-6)
    assert got[CLIENT] == 0.0  # never negative: noise, not a refund


def test_repeats_of_a_width_are_averaged_in_first_seen_order() -> None:
    rows = [
        Width("lockstep", 1, {ROUTER: 100e-6}),
        Width("lockstep", 2, {ROUTER: 60e-6}),
        Width("lockstep", 1, {ROUTER: 200e-6}),
    ]
    got = mean_widths(rows)
    assert [(r.mode, r.width) for r in got] == [("lockstep", 1), ("lockstep", 2)]
    assert got[0].per_token[ROUTER] == pytest.approx(150e-6)
    assert got[1].per_token[ROUTER] == pytest.approx(60e-6)


def test_the_table_shows_each_widths_share_against_its_own_modes_lone_cost() -> None:
    # Alone 100 us; two streams 75 us a token: (1 - 0.75) * 2 / 1 = 0.50 of the lone cost is
    # the wake-up. The staggered mode has no width 1: no share to show.
    rows = [
        Width("lockstep", 1, {ROUTER: 100e-6, "colocated": 0.0, CLIENT: 80e-6}),
        Width("lockstep", 2, {ROUTER: 75e-6, "colocated": 0.0, CLIENT: 80e-6}),
        Width("staggered", 2, {ROUTER: 75e-6, "colocated": 0.0, CLIENT: 80e-6}),
    ]
    lines = render(rows).splitlines()
    assert lines[3] == "| lockstep | 2 | 75.0 (0.50) | 0.0 | 80.0 (0.00) |"
    assert lines[4] == "| staggered | 2 | 75.0 | 0.0 | 80.0 |"


def _sse(n_tokens: int) -> bytes:
    chunks = [{"choices": [{"text": "a"}]} for _ in range(n_tokens)]
    chunks.append({"choices": [], "usage": {"completion_tokens": n_tokens}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


def test_staggered_sends_every_prompt_once_with_at_most_width_in_flight() -> None:
    seen: list[list[int]] = []
    state = {"now": 0, "most": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        state["now"] += 1
        state["most"] = max(state["most"], state["now"])
        seen.append(json.loads(request.content)["prompt"])
        await asyncio.sleep(0)  # let the other lanes send meanwhile
        state["now"] -= 1
        return httpx.Response(200, content=_sse(json.loads(request.content)["max_tokens"]))

    prompts = [[i] for i in range(7)]

    async def run() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await staggered(client, "http://r", "m", prompts, 2, width=3, gap=0.0)

    assert asyncio.run(run()) == 7
    assert sorted(seen) == prompts
    assert state["most"] == 3
