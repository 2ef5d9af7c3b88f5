"""continue_sequence: a request resumed from tokens generated elsewhere continues exactly as the
uninterrupted run, greedy and seeded (CPU generators are fast-forwarded)."""

from __future__ import annotations

import pytest

from tandem.engine.engine import Engine
from tandem.engine.llm import build_engine_config
from tandem.engine.resume import continue_sequence
from tandem.engine.sampling_params import SamplingParams

PROMPT = [256, 10, 20, 30, 40, 50, 60]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(build_engine_config("demo", num_blocks=64))


def run(engine: Engine, rid: str, params: SamplingParams, resume: list[int] = ()) -> list[int]:
    (req,) = engine.make_requests(rid, PROMPT, params)
    continue_sequence(req, list(resume), engine.arch.vocab_size)
    engine.enqueue(req)
    tokens: list[int] = []
    while engine.has_unfinished:
        for o in engine.step():
            tokens += o.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=9,
            max_tokens=24,
            ignore_eos=True,
            frequency_penalty=0.5,
        ),  # fmt: skip
    ],
)
def test_resumed_sequence_equals_the_uninterrupted_one(engine: Engine, params) -> None:
    whole = run(engine, "whole", params)
    for k in (1, 7):
        assert whole[:k] + run(engine, f"resumed-{k}", params, whole[:k]) == whole


def test_resume_bounds_are_checked(engine: Engine) -> None:
    (req,) = engine.make_requests("r", PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="out of range"):
        continue_sequence(req, [10_000], engine.arch.vocab_size)
    with pytest.raises(ValueError, match="max_tokens"):
        continue_sequence(req, [1, 2, 3], engine.arch.vocab_size)
    assert req.num_output_tokens == 0
