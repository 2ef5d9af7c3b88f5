import math
from collections import Counter

import pytest
import torch

from tandem.engine.sampler import Sampler, SamplingRow, apply_penalties
from tandem.engine.sampling_params import SamplingParams

VOCAB = 64


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), prompt or [], output or [], g)


def probs_to_logits(probs: list[float], vocab: int = VOCAB) -> torch.Tensor:
    """Logits whose softmax is `probs` on the first tokens and (practically) 0 elsewhere."""
    logits = torch.full((vocab,), -1e4)
    logits[: len(probs)] = torch.tensor([math.log(p) for p in probs])
    return logits


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.tensor(
        [
            [0.1, 3.0, -1.0, 2.9],
            [5.0, 5.0, 1.0, 5.0],  # tie: lowest id wins
            [-3.0, -2.0, -2.5, -9.0],
        ]
    )
    out = Sampler()(logits, [row(temperature=0.0)] * 3)
    assert out.token_ids == [1, 0, 1]
    assert out.logprobs == [None, None, None]
    out = Sampler()(logits.to(torch.bfloat16), [row(temperature=0.0)] * 3)
    assert out.token_ids == [1, 0, 1]


def test_greedy_slow_path_matches_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    fast = Sampler()(logits, [row(temperature=0.0)] * 6).token_ids
    # A random row in the batch forces the general path for the greedy rows.
    mixed = Sampler()(logits, [row(temperature=0.0)] * 5 + [row(seed=1)]).token_ids
    assert mixed[:5] == fast[:5] == logits.argmax(-1).tolist()[:5]


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, VOCAB)
    greedy = Sampler()(logits, [row(temperature=0.0)] * 8).token_ids
    top1 = Sampler()(logits, [row(temperature=1.5, top_k=1, seed=i) for i in range(8)]).token_ids
    assert top1 == greedy


def sample_many(logits_row: torch.Tensor, n: int, **params: object) -> Counter:
    torch.manual_seed(1234)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return Counter(Sampler()(logits, [row(**params)] * n).token_ids)


def test_top_k_samples_only_top_k() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))
    allowed = set(logits.topk(4).indices.tolist())
    counts = sample_many(logits, 2000, top_k=4, temperature=3.0)
    assert set(counts) == allowed


def test_top_k_larger_than_vocab_is_no_op() -> None:
    counts = sample_many(probs_to_logits([0.5, 0.5], vocab=2), 500, top_k=10)
    assert set(counts) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = probs_to_logits([0.5, 0.3, 0.15, 0.05])
    assert set(sample_many(logits, 400, top_p=0.6)) == {0, 1}
    assert set(sample_many(logits, 400, top_p=0.85)) == {0, 1, 2}
    assert set(sample_many(logits, 400, top_p=0.4)) == {0}


def test_top_p_is_applied_after_top_k_renormalization() -> None:
    # After top_k=3 the probabilities are 4/9, 3/9, 2/9: the mass before token 2 is 7/9 > 0.75,
    # so token 2 goes; on the unrenormalized 0.4, 0.3, 0.2 it would stay (0.7 < 0.75).
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1])
    assert set(sample_many(logits, 400, top_k=3, top_p=0.75)) == {0, 1}


def test_filters_apply_per_row_in_a_mixed_batch() -> None:
    logits = probs_to_logits([0.25, 0.25, 0.25, 0.25], vocab=4)
    kinds = [{"top_k": 2}, {}, {"top_p": 0.3}, {"top_k": 3, "min_p": 0.6}, {"top_k": -1}]
    n = 600
    torch.manual_seed(11)
    rows = [row(**kinds[i % len(kinds)]) for i in range(n)]
    tokens = Sampler()(logits.expand(n, -1).contiguous(), rows).token_ids
    seen = [set(tokens[i :: len(kinds)]) for i in range(len(kinds))]
    # Ties at the k-th value survive top-k, so a flat row keeps everything under top_k=2.
    assert seen == [{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1], vocab=4)
    tokens = Sampler()(logits.expand(n, -1).contiguous(), rows).token_ids
    seen = [set(tokens[i :: len(kinds)]) for i in range(len(kinds))]
    assert seen == [{0, 1}, {0, 1, 2, 3}, {0}, {0, 1}, {0, 1, 2, 3}]


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1])
    assert set(sample_many(logits, 400, min_p=0.6)) == {0, 1}  # threshold 0.24
    assert set(sample_many(logits, 400, min_p=0.45)) == {0, 1, 2}  # threshold 0.18


def test_temperature_applies_before_filters() -> None:
    # Temperature 0.5 squares the odds: 0.4,0.3,0.2,0.1 becomes 16:9:4:1, so 16/30 + 9/30 > 0.8.
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1])
    assert set(sample_many(logits, 400, temperature=0.5, top_p=0.8)) == {0, 1}
    assert set(sample_many(logits, 400, top_p=0.8)) == {0, 1, 2}


def test_sampling_follows_the_distribution() -> None:
    counts = sample_many(probs_to_logits([0.5, 0.25, 0.25]), 8000)
    assert set(counts) == {0, 1, 2}
    for token, p in [(0, 0.5), (1, 0.25), (2, 0.25)]:
        assert abs(counts[token] / 8000 - p) < 0.03


def step_logits(seed: int, step: int, prev: int) -> torch.Tensor:
    """Deterministic logits of one sequence at one step, depending on its previous token."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + prev)
    return torch.randn(VOCAB, generator=g) * 2


def run_batch(layout: list[tuple[str, int | None]], steps: int) -> dict[str, list[int]]:
    """Decode `steps` tokens for named sequences (name, seed) batched together."""
    gens = {name: torch.Generator().manual_seed(s) if s is not None else None for name, s in layout}
    outputs: dict[str, list[int]] = {name: [] for name, _ in layout}
    for step in range(steps):
        rows, logits = [], []
        for i, (name, _) in enumerate(layout):
            prev = outputs[name][-1] if outputs[name] else 0
            logits.append(step_logits(i if name.startswith("other") else 99, step, prev))
            params = SamplingParams(
                temperature=0.9, top_p=0.95, top_k=40, frequency_penalty=0.5, logprobs=1
            )
            if name.startswith("other-greedy"):
                params = SamplingParams(temperature=0.0)
            rows.append(SamplingRow(params, [1, 2, 3], outputs[name], gens[name]))
        for (name, _), token in zip(
            layout, Sampler()(torch.stack(logits), rows).token_ids, strict=True
        ):
            outputs[name].append(token)
    return outputs


def test_seeded_row_is_independent_of_the_batch() -> None:
    torch.manual_seed(7)
    alone = run_batch([("me", 1234)], steps=6)["me"]
    first = run_batch([("me", 1234), ("other1", None), ("other2", 5)], steps=6)["me"]
    middle = run_batch(
        [("other1", 9), ("other-greedy", None), ("me", 1234), ("other3", None)], steps=6
    )["me"]
    last = run_batch([("other1", None)] * 4 + [("me", 1234)], steps=6)["me"]
    assert alone == first == middle == last
    assert run_batch([("me", 4321)], steps=6)["me"] != alone


def test_unseeded_rows_use_the_global_rng() -> None:
    logits = torch.zeros(4, VOCAB)
    torch.manual_seed(3)
    a = Sampler()(logits, [row()] * 4).token_ids
    torch.manual_seed(3)
    b = Sampler()(logits, [row()] * 4).token_ids
    assert a == b


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0], [2.0, -1.0, 0.5, -3.0, 4.0]])
    rows = [
        row(prompt=[0, 1], output=[1, 3], repetition_penalty=2.0),
        row(prompt=[4], output=[], repetition_penalty=0.5),
    ]
    expected = torch.tensor([[1.0, -2.0, 0.5, -6.0, 4.0], [2.0, -1.0, 0.5, -3.0, 8.0]])
    assert torch.equal(apply_penalties(logits, rows), expected)


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rows = [row(prompt=[3, 3], output=[0, 2, 0, 0], presence_penalty=0.5, frequency_penalty=0.25)]
    # token 0: count 3 -> 1 - 0.75 - 0.5; token 2: count 1 -> 1 - 0.25 - 0.5; prompt-only 3 as is
    expected = torch.tensor([[-0.25, 1.0, 0.25, 1.0]])
    assert torch.equal(apply_penalties(logits, rows), expected)


def test_all_penalties_combined() -> None:
    logits = torch.tensor([[3.0, -2.0, 1.0]])
    rows = [
        row(
            prompt=[2],
            output=[0, 1, 1],
            repetition_penalty=1.5,
            presence_penalty=-1.0,
            frequency_penalty=1.0,
        )
    ]
    expected = torch.tensor([[3.0 / 1.5 - 1.0 + 1.0, -2.0 * 1.5 - 2.0 + 1.0, 1.0 / 1.5]])
    assert torch.equal(apply_penalties(logits, rows), expected)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [row(output=[0], temperature=0.0, repetition_penalty=2.0), row(temperature=0.0)]
    assert Sampler()(logits, rows).token_ids == [1, 0]


def test_penalty_token_out_of_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 3\)"):
        Sampler()(torch.zeros(1, 3), [row(output=[3], repetition_penalty=1.2)])


def test_logprobs_chosen_rank_and_top_n() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0], [0.5, -0.5, 2.5, 1.5, 0.0]])
    rows = [row(temperature=0.0, logprobs=3), row(temperature=0.0, logprobs=0)]
    out = Sampler()(logits, rows)
    lp = torch.log_softmax(logits, dim=-1)
    first, second = out.logprobs
    assert first is not None and second is not None
    assert (first.token_id, first.rank) == (1, 1)
    assert first.logprob == lp[0, 1].item()
    assert first.top == [(1, lp[0, 1].item()), (2, lp[0, 2].item()), (0, lp[0, 0].item())]
    assert (second.token_id, second.rank, second.top) == (2, 1, [])
    assert second.logprob == lp[1, 2].item()


def test_logprobs_of_a_sampled_token_are_pre_temperature_post_penalty() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rows = [row(output=[0], seed=0, temperature=2.0, repetition_penalty=4.0, logprobs=2)]
    out = Sampler()(logits, rows)
    penalized = torch.tensor([[0.5, 1.0, 0.0, -1.0]])
    lp = torch.log_softmax(penalized, dim=-1)
    entry = out.logprobs[0]
    assert entry is not None
    token = out.token_ids[0]
    assert entry.token_id == token
    assert entry.logprob == lp[0, token].item()
    assert entry.rank == int((lp[0] > lp[0, token]).sum()) + 1
    assert entry.top == [(1, lp[0, 1].item()), (0, lp[0, 0].item())]


def test_logprobs_only_where_requested() -> None:
    out = Sampler()(torch.randn(3, VOCAB), [row(logprobs=1, seed=0), row(seed=1), row(seed=2)])
    assert out.logprobs[0] is not None and out.logprobs[1:] == [None, None]
    assert out.logprobs[0].token_id == out.token_ids[0]


def test_bad_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"logits must have shape \[2, vocab\], got \[3, 4\]"):
        Sampler()(torch.zeros(3, 4), [row(), row()])
    with pytest.raises(ValueError, match="float tensor"):
        Sampler()(torch.zeros(1, 4, dtype=torch.long), [row()])


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []
