"""KV cache write, paged decode attention and paged extend attention against their references,
on strided layer views of a block-major cache filled with random data."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from paged_cases import (
    ATOL,
    CHUNKS,
    HEADS,
    HEADS_IDS,
    LAYER,
    RTOL,
    WINDOW_CASES,
    Heads,
    make_block_tables,
    make_kv_cache,
    pack_chunks,
)

from tandem.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from tandem.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from tandem.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref


@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_cache_write_scatters_into_strided_views_and_skips_padding(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    heads = Heads(8, 2, 80, block_size)
    kv_cache = make_kv_cache(heads, num_blocks=6, gen=gen)
    expected = kv_cache.clone()
    # k and v are strided views of a fused projection output, like the model produces.
    qkv = torch.randn((7, heads.num_heads + 2 * heads.num_kv_heads, heads.head_dim), generator=gen)
    k = qkv[:, heads.num_heads : heads.num_heads + 2]
    v = qkv[:, heads.num_heads + 2 :]
    last = 6 * block_size - 1
    slots = torch.tensor([0, -1, block_size - 1, block_size, 3 * block_size + 5, last, -1])

    kv_cache_write(k, v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    kv_cache_write_ref(k, v, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)

    assert torch.equal(kv_cache, expected)
    assert torch.equal(kv_cache[5, LAYER, 1, block_size - 1], v[5])
    assert torch.equal(kv_cache[:, 0], expected[:, 0])  # the other layer is untouched


@pytest.mark.parametrize("heads", HEADS, ids=HEADS_IDS)
def test_paged_decode_attention_matches_reference(heads: Heads, poisoned_alloc: None) -> None:
    gen = torch.Generator().manual_seed(heads.head_dim + heads.num_heads)
    # One token, block boundaries either side, a multi-block sequence, and a padded row (len 0).
    seq_lens = [1, 15, 16, 17, 32, 33, 70, 0]
    num_blocks = 24
    kv_cache = make_kv_cache(heads, num_blocks, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    block_tables = make_block_tables(seq_lens, heads.block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn((len(seq_lens), heads.num_heads, heads.head_dim), generator=gen)
    scale = heads.head_dim**-0.5

    expected = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    assert torch.equal(expected[-1], torch.zeros_like(expected[-1]))
    # 1 split, 3 splits (some empty for short rows) and more splits than any row has tiles; the
    # 64-wide tile is the CUDA default.
    for num_splits, block_n in ((1, 64), (3, 16), (8, 32)):
        out = paged_decode_attention(
            q, k_cache, v_cache, block_tables, lens, scale, num_splits=num_splits, block_n=block_n
        )
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", HEADS, ids=HEADS_IDS)
def test_paged_extend_attention_matches_reference(heads: Heads) -> None:
    gen = torch.Generator().manual_seed(heads.head_dim * 7 + heads.num_kv_heads)
    query_start_loc, lens, seq_lens = pack_chunks(CHUNKS)
    num_blocks = 24
    kv_cache = make_kv_cache(heads, num_blocks, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    block_tables = make_block_tables(seq_lens, heads.block_size, num_blocks, gen)
    num_query = int(query_start_loc[-1])
    pad_rows = 3
    q = torch.randn((num_query + pad_rows, heads.num_heads, heads.head_dim), generator=gen)
    max_query_len = max(c.query_len for c in CHUNKS)
    scale = heads.head_dim**-0.5

    expected = paged_extend_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, lens, scale
    )
    # Interpreter-sized tiles, then the CUDA defaults (several query tiles per chunk vs one).
    for block_m, block_n in ((16, 16), (64, 64)):
        out = torch.full_like(q, float("nan"))
        paged_extend_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, lens, max_query_len, scale,
            out=out, block_m=block_m, block_n=block_n,
        )  # fmt: skip
        torch.testing.assert_close(out[:num_query], expected[:num_query], atol=ATOL, rtol=RTOL)
        assert out[num_query:].isnan().all()  # rows past the batch are never written


def test_extend_of_decode_rows_equals_decode_kernel() -> None:
    """A decode batch through the extend kernel (mixed-batch path) agrees with the decode kernel."""
    heads = Heads(8, 2, 64, 16)
    gen = torch.Generator().manual_seed(3)
    seq_lens = [33, 1, 16]
    kv_cache = make_kv_cache(heads, 10, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    block_tables = make_block_tables(seq_lens, heads.block_size, 10, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn((3, heads.num_heads, heads.head_dim), generator=gen)
    starts = torch.arange(4, dtype=torch.int32)
    via_extend = paged_extend_attention(q, k_cache, v_cache, block_tables, starts, lens, 1, 0.125)
    via_decode = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    torch.testing.assert_close(via_extend, via_decode, atol=ATOL, rtol=RTOL)


def test_wrappers_reject_bad_input_without_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    heads = Heads(6, 4, 64, 16)  # 6 query heads are not a multiple of 4 KV heads
    gen = torch.Generator().manual_seed(0)
    kv_cache = make_kv_cache(heads, 4, gen)
    before = kv_cache.clone()
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    q = torch.randn((2, 6, 64), generator=gen)
    tables = torch.zeros((2, 2), dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q[:, :4].double(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q[:, :4], k_cache, v_cache, tables, lens[:1], 1.0)
    k = torch.randn((2, 4, 64), generator=gen)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache_write(k, k, k_cache, v_cache, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_write(k.half(), k.half(), k_cache, v_cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_extend_attention(q[:, :4], k_cache, v_cache, tables, lens, lens, 2, 1.0)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="need CUDA tensors"):
            kv_cache_write(k, k, k_cache, v_cache, torch.tensor([1, 2]))
    assert torch.equal(kv_cache, before)


def test_decode_and_extend_share_one_argument_checker() -> None:
    """The same bad argument gets the same message from both wrappers (one checker)."""
    heads = Heads(4, 2, 64, 16)
    gen = torch.Generator().manual_seed(1)
    kv_cache = make_kv_cache(heads, 4, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    q = torch.randn((2, 4, 64), generator=gen)
    tables = torch.zeros((2, 2), dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)

    def both(tables: torch.Tensor, lens: torch.Tensor, **kw: int) -> list[Callable[[], object]]:
        return [
            lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, **kw),
            lambda: paged_extend_attention(q, k_cache, v_cache, tables, starts, lens, 1, 1.0, **kw),
        ]

    cases = [
        (
            both(tables, torch.tensor([3, 0, 4, 0], dtype=torch.int32)[::2]),
            "seq_lens must be contiguous",
        ),
        (both(torch.zeros((2, 4), dtype=torch.int32)[:, ::2], lens), "block_tables rows must be"),
        (both(tables, lens.float()), "seq_lens must have dtype"),
        (both(tables, lens, block_n=24), "block_n must be a power of two"),
    ]
    for calls, message in cases:
        for call in calls:
            with pytest.raises(ValueError, match=message):
                call()


@pytest.mark.parametrize("window", WINDOW_CASES)
def test_sliding_window_decode_and_extend_match_reference(window: int) -> None:
    """Mistral's sliding window in both Triton kernels: decode with splits (some starting inside
    the window's first tile) and extend chunks whose rows see different ranges."""
    heads = Heads(8, 2, 64, 16)
    gen = torch.Generator().manual_seed(window)
    seq_lens = [1, 15, 16, 17, 33, 70, 0]
    num_blocks = 24
    kv_cache = make_kv_cache(heads, num_blocks, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    tables = make_block_tables(seq_lens, heads.block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn((len(seq_lens), heads.num_heads, heads.head_dim), generator=gen)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, window)
    for num_splits in (1, 3):
        out = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits, block_n=16,
            window=window,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)

    starts, lens, chunk_lens = pack_chunks(CHUNKS)
    tables = make_block_tables(chunk_lens, heads.block_size, num_blocks, gen)
    q = torch.randn((int(starts[-1]), heads.num_heads, heads.head_dim), generator=gen)
    expected = paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.125, window)
    max_q = max(c.query_len for c in CHUNKS)
    out = paged_extend_attention(
        q, k_cache, v_cache, tables, starts, lens, max_q, 0.125, block_m=16, block_n=16,
        window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    if window < 1000:  # the window changed something, so the test can fail
        full = paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.125)
        assert not torch.allclose(full, expected)
