"""Decode attention's launch choices: the split-K rule (from the H200 sweep of
benchmarks/decode_tuning_gpu.py), the launch options' checks, and parity with them set."""

from __future__ import annotations

import pytest
import torch
from paged_cases import ATOL, LAYER, RTOL, Heads, make_block_tables, make_kv_cache

from tandem.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

H200_SMS = 132


@pytest.mark.parametrize(
    ("num_seqs", "ctx", "want"),
    [
        # Short contexts: no split (a split keeps >= 1024 positions).
        (1, 1024, 1), (64, 1024, 1), (256, 1024, 1),
        # Few sequences: split towards four programs per SM, a power of two at or below.
        (1, 4096, 4), (1, 16384, 16), (8, 4096, 4), (8, 16384, 8), (32, 16384, 2),
        # A full GPU still splits long contexts in two (batch 64 x 4k: 70 % -> 96 % of copy).
        (64, 4096, 2), (128, 4096, 2), (256, 4096, 2), (256, 131072, 2),
        (1, 1 << 20, 32),  # at most 32
    ],
)  # fmt: skip
def test_choose_num_splits_follows_the_sweep(num_seqs: int, ctx: int, want: int) -> None:
    assert choose_num_splits(num_seqs, 8, ctx, H200_SMS) == want


def test_choose_num_splits_is_a_power_of_two_within_bounds() -> None:
    for num_seqs in (0, 1, 3, 7, 33, 100, 1000):
        for ctx in (1, 1023, 2048, 3000, 4096, 5000, 70000):
            for sms in (1, 80, 132):
                s = choose_num_splits(num_seqs, 8, ctx, sms)
                assert 1 <= s <= 32 and s & (s - 1) == 0, (num_seqs, ctx, sms, s)
                assert s >= 2 if ctx >= 4096 else s <= max(1, ctx // 1024)


def _case(gen: torch.Generator):
    heads = Heads(8, 2, 64, 16)
    lens = [5, 40, 70]
    kv = make_kv_cache(heads, 16, gen)
    tables = make_block_tables(lens, heads.block_size, 16, gen)
    q = torch.randn((len(lens), heads.num_heads, heads.head_dim), generator=gen)
    return q, kv, kv[:, LAYER, 0], kv[:, LAYER, 1], tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_warps": 3}, "num_warps must be 1, 2, 4, 8 or 16, got 3"),
    ({"num_stages": 0}, "num_stages must be >= 1, got 0"),
])  # fmt: skip
def test_bad_launch_options_are_refused_before_writing(kwargs: dict, match: str) -> None:
    q, kv, k_cache, v_cache, tables, lens = _case(torch.Generator().manual_seed(0))
    out = torch.full_like(q, 7.0)
    before = kv.clone()
    with pytest.raises(ValueError, match=f"paged_decode_attention: {match}"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out, **kwargs)
    assert torch.equal(out, torch.full_like(q, 7.0)) and torch.equal(kv, before)


def test_launch_options_keep_the_reference_result() -> None:
    q, _, k_cache, v_cache, tables, lens = _case(torch.Generator().manual_seed(1))
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    for splits, warps, stages in ((1, 8, 2), (2, 4, 2), (4, 2, 3)):
        got = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 0.125, num_splits=splits, block_n=16,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
