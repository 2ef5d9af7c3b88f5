"""The offline API and engine loop: validation, seeds, stops, n > 1, aborts and accounting."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.request import RequestStatus


@pytest.fixture(scope="module")
def llm(llama_gqa_path: Path) -> LLM:
    return LLM(str(llama_gqa_path), num_blocks=96, max_model_len=200)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(n)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt(0, 200)], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10_000]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished
    out = llm.generate([prompt(1, 5)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    llm.engine.check_integrity()


def test_bad_request_mid_stream_does_not_disturb_running_ones(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(
        "good", prompt(2, 9), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    engine.step()
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("bad", prompt(2, 9), SamplingParams(top_p=2.0))
    tokens = []
    while engine.has_unfinished:
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 3
    engine.check_integrity()


def test_seeded_sampling_is_independent_of_batch_composition(llm: LLM) -> None:
    p = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    alone = llm.generate([prompt(3, 20)], p)[0].token_ids
    others = [prompt(9, 7), prompt(10, 33)]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([others[0], prompt(3, 20), others[1]], [noise, p, noise])
    assert batch[1].token_ids == alone
    p2 = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12, ignore_eos=True
    )
    assert llm.generate([prompt(3, 20)], p2)[0].token_ids != alone


def test_n_greater_than_one_shares_the_prompt_blocks(llm: LLM) -> None:
    engine = llm.engine
    before = engine.stats().prefix_hit_tokens
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate([prompt(4, 40)], p)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    # Siblings waited for the first one's prompt and hit its two full blocks.
    assert engine.stats().prefix_hit_tokens - before == 2 * 32
    engine.check_integrity()


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = llm.generate([prompt(5, 10)], greedy)[0].token_ids
    stop_at = full[3]
    first = full.index(stop_at)
    out = llm.generate(
        [prompt(5, 10)],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    greedy = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, skip_special_tokens=False
    )
    full = llm.generate([prompt(6, 10)], greedy)[0]
    text = full.text
    assert len(text) >= 3
    stop = text[2:4]
    cut = text.index(stop)
    out = llm.generate(
        [prompt(6, 10)],
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], skip_special_tokens=False
        ),
    )[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    llm.engine.check_integrity()


def test_abort_returns_every_block(llm: LLM) -> None:
    engine = llm.engine
    free0 = engine.pool.num_free_blocks
    engine.add_request("a1", prompt(7, 50), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("a2", prompt(8, 50), SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    outs = engine.abort(["a1", "a2"])
    assert sorted(o.request_id for o in outs) == ["a1", "a2-0", "a2-1"]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished
    assert engine.pool.num_free_blocks == free0
    engine.check_integrity()


def test_logprobs_report_the_chosen_token(llm: LLM) -> None:
    out = llm.generate(
        [prompt(9, 12)], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    )[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for tok, lp in zip(out.token_ids, lps, strict=True):
        assert lp.token_id == tok and lp.rank == 1 and lp.logprob <= 0.0
        assert len(lp.top) == 2 and lp.top[0][0] == tok


def test_priority_and_fcfs_order_admission(llama_gqa_path: Path) -> None:
    llm = LLM(str(llama_gqa_path), num_blocks=64, max_num_seqs=1)
    engine = llm.engine
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", prompt(1, 5), p, priority=5)
    engine.add_request("high", prompt(2, 5), p, priority=0)
    engine.add_request("high2", prompt(3, 5), p, priority=0)
    order = []
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["high", "high2", "low"]
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def test_unchunked_prefill_needs_a_budget_of_max_model_len() -> None:
    """Without chunked prefill a prompt longer than the budget would wait forever: the config is
    refused; with the budget at max_model_len the longest prompt runs in one step."""
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_model_len, got 16 < 256"):
        LLM("demo", enable_chunked_prefill=False, max_num_batched_tokens=16)
    llm = LLM("demo", enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(3, 63))  # 60 tokens, admitted whole
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    llm.engine.check_integrity()
