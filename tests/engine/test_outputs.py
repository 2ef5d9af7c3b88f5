"""A step's outputs (engine/outputs.py): a step where every request goes on returns a
StepOutputs, made when read, whose outputs are exactly what the engine built eagerly before;
it holds the step's tokens even when read after later steps; a step where one ends is a list."""

from __future__ import annotations

import time

import pytest

from tandem.engine.engine import Engine
from tandem.engine.llm import build_engine_config
from tandem.engine.outputs import EngineOutput, StepOutputs, request_outputs
from tandem.engine.sampling_params import SamplingParams

NUM_BLOCKS = 64
PROMPTS = {"a": [256, 5, 6, 7], "b": [256, 8, 9], "c": [256, 1, 2, 3, 4]}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(build_engine_config("demo", num_blocks=NUM_BLOCKS))


def admit(engine: Engine, params: SamplingParams) -> None:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)


def test_a_step_where_all_go_on_is_made_when_read_and_equals_the_eager_outputs(
    engine: Engine,
) -> None:
    admit(engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    seen: list[StepOutputs] = []
    expected: list[list[EngineOutput]] = []
    ends: list[list[EngineOutput]] = []
    while engine.has_unfinished:
        outs = engine.step()
        if isinstance(outs, StepOutputs):
            reqs = [engine._requests[rid] for rid in PROMPTS]
            lps = {o.request_id: o.logprobs[0] for o in outs}  # reading makes them
            expected.append(request_outputs(reqs, lps))  # what the engine built before
            seen.append(outs)
        else:
            ends.append(list(outs))
    # Prompt step + 2 decode steps go on; the 4th token ends all three (a list).
    assert len(seen) == 3 and len(ends) == 1
    for got, want in zip(seen, expected, strict=True):
        assert list(got) == want
        assert got == want and len(got) == 3 and got[1] == want[1]
    assert all(o.finished and o.finish_reason == "length" for o in ends[0])
    assert all(o.logprobs and o.logprobs[0].token_id == o.new_token_ids[0] for o in ends[0])
    assert engine.pool.num_free_blocks == NUM_BLOCKS


def test_a_snapshot_keeps_its_step_tokens_after_the_requests_move_on(engine: Engine) -> None:
    admit(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    unread: list[StepOutputs] = []
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished:
        outs = engine.step()
        if isinstance(outs, StepOutputs):
            unread.append(outs)  # read only once every request has finished
        else:
            for o in outs:
                tokens[o.request_id] += o.new_token_ids
    read: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for outs in unread:
        for o in outs:
            assert not o.finished and o.finish_reason is None and o.error is None
            assert o.num_prompt_tokens == len(PROMPTS[o.request_id])
            read[o.request_id] += o.new_token_ids
    for rid in PROMPTS:
        full = read[rid] + tokens[rid]
        assert len(full) == 6 and len(read[rid]) == 5
    # The same run done eagerly gives the same tokens in the same order.
    admit(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eager: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished:
        for o in engine.step():
            eager[o.request_id] += o.new_token_ids
    assert eager == {rid: read[rid] + tokens[rid] for rid in PROMPTS}


def test_a_final_output_carries_where_the_request_spent_its_time() -> None:
    # One sequence at a time: "b" waits in the queue while "a" runs to its end.
    eng = Engine(build_engine_config("demo", num_blocks=NUM_BLOCKS, max_num_seqs=1))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    t0 = time.monotonic()
    eng.add_request("a", PROMPTS["a"], params)
    eng.add_request("b", PROMPTS["b"], params)
    eng.add_request("c", PROMPTS["c"], params)
    finals: dict[str, EngineOutput] = {}
    while "b" not in finals:
        for out in eng.step():
            assert (out.timings is not None) == out.finished  # on a final output alone
            if out.finished:
                finals[out.request_id] = out
    (aborted,) = eng.abort(["c"])  # still waiting: never admitted, no token
    a, b, c = finals["a"].timings, finals["b"].timings, aborted.timings
    assert a is not None and b is not None and c is not None
    for t in (a, b):
        assert t0 <= t.arrival <= t.first_scheduled <= t.first_token <= t.finished  # type: ignore[operator]
    assert b.first_scheduled >= a.finished  # type: ignore[operator]
    assert b.queue_seconds == b.first_scheduled - b.arrival  # type: ignore[operator]
    assert b.first_token_seconds == b.first_token - b.arrival  # type: ignore[operator]
    assert c.first_scheduled is None and c.first_token is None
    assert c.queue_seconds is None and c.first_token_seconds is None
    assert c.total_seconds == c.finished - c.arrival >= 0
    assert eng.pool.num_free_blocks == NUM_BLOCKS
