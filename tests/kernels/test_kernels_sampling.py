"""Greedy argmax kernel and the seeded top-k/top-p sampler."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.sampling import (
    greedy_sample,
    greedy_sample_ref,
    top_k_top_p_sample,
    top_k_top_p_sample_ref,
)


def test_greedy_sample_matches_argmax_with_ties_across_chunks(poisoned_alloc: None) -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 5000  # two 4096-wide chunks, the second partial
    logits = torch.randn((5, vocab), generator=gen)
    logits[1, 4500] = logits[1, 10] = 50.0  # tie across chunks: first wins
    logits[2, 4095] = logits[2, 4096] = 50.0  # tie at the chunk seam
    logits[3, vocab - 1] = 50.0  # last element
    logits[4, 7] = logits[4, 9] = 50.0  # tie inside one chunk
    out = greedy_sample(logits)
    assert out.dtype == torch.int64
    assert torch.equal(out, greedy_sample_ref(logits))
    assert out[1:].tolist() == [10, 4095, vocab - 1, 7]
    strided = torch.randn((3, 2 * 300), generator=gen)[:, :300]
    assert torch.equal(greedy_sample(strided), torch.argmax(strided, dim=-1))


def _params(rows: list[tuple[float, int, float]]) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
    )


def test_seeded_rows_depend_only_on_their_own_generator() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn((4, 50), generator=gen)
    temperature, top_k, top_p = _params([(1.0, 0, 1.0), (0.7, 10, 0.9), (1.3, 5, 1.0), (0.0, 0, 1)])

    def draw(order: list[int], seeds: list[int | None]) -> list[int]:
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        idx = torch.tensor(order)
        return top_k_top_p_sample(
            logits[idx], temperature[idx], top_k[idx], top_p[idx], [gens[i] for i in order]
        ).tolist()

    first = draw([0, 1, 2, 3], [11, 12, 13, 14])
    assert draw([0, 1, 2, 3], [11, 12, 13, 14]) == first
    reordered = draw([2, 0, 3, 1], [11, 12, 13, 14])
    assert reordered == [first[2], first[0], first[3], first[1]]
    # Row 1 alone, next to unseeded neighbours, still draws the same token.
    assert draw([1, 0], [None, 12, None, None])[0] == first[1]
    assert first[3] == int(torch.argmax(logits[3]))  # temperature 0 is greedy


def test_samples_follow_the_top_k_top_p_distribution() -> None:
    gen = torch.Generator().manual_seed(9)
    vocab, draws = 12, 6000
    row = torch.randn((vocab,), generator=gen) * 2
    cases = [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.2, 0, 0.6), (1.0, 6, 0.8)]
    for temp, k, p in cases:
        logits = row.expand(draws, vocab)
        temperature, top_k, top_p = (
            torch.full((draws,), temp),
            torch.full((draws,), k),
            torch.full((draws,), p),
        )
        gens = [torch.Generator().manual_seed(1000 + i) for i in range(draws)]
        tokens = top_k_top_p_sample(logits, temperature, top_k, top_p, gens)
        expected = top_k_top_p_sample_ref(row[None], temperature[:1], top_k[:1], top_p[:1])[0]
        freq = torch.bincount(tokens, minlength=vocab).double() / draws
        assert (freq[expected == 0] == 0).all(), (temp, k, p)  # nothing outside the support
        assert (freq - expected).abs().max() < 0.03, (temp, k, p, freq, expected)
        if k:
            assert int((expected > 0).sum()) <= k


def test_top_k_top_p_rejects_bad_parameters() -> None:
    logits = torch.randn((2, 10))
    ok = (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p_sample(logits, ok[0], ok[1], torch.tensor([1.0, 0.0]), [None, None])
    with pytest.raises(ValueError, match="temperature"):
        top_k_top_p_sample(logits, torch.tensor([1.0, -1.0]), ok[1], ok[2], [None, None])
    with pytest.raises(ValueError, match="generator"):
        top_k_top_p_sample(logits, *ok, [None])
    with pytest.raises(ValueError, match="top_k"):
        top_k_top_p_sample(logits, ok[0], torch.zeros(2), ok[2], [None, None])
