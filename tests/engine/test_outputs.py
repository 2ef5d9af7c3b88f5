"""A step's outputs (engine/outputs.py): a step where every request goes on returns a
StepOutputs, made when read, whose outputs are exactly what the engine built eagerly before;
it holds the step's tokens even when read after later steps; a step where one ends is a list."""

from __future__ import annotations

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
