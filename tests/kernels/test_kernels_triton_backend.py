"""TritonAttentionBackend.forward over a prefill step, a mixed step and a decode step, checked
against the kernel references and against the cache contents the steps must leave behind; the
torch backend's CPU fast paths over the same steps against the same references."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, get_backend
from tandem.kernels.decode_attention import paged_decode_attention_ref
from tandem.kernels.extend_attention import paged_extend_attention_ref

BLOCK_SIZE = 16
NUM_BLOCKS = 12
NUM_LAYERS = 2
HQ, HKV, D = 8, 2, 64
SCALE = D**-0.5


def make_meta(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    num_tokens: int,
) -> AttentionMetadata:
    """Metadata for sequences whose query tokens are the last query_lens of seq_lens; token rows
    past the real ones are padding (slot -1)."""
    slots: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s_len - q_len, s_len):
            slots.append(int(block_tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots += [-1] * (num_tokens - len(slots))
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(
            [s - q for q, s in zip(query_lens, seq_lens, strict=True)], dtype=torch.int32
        ),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


@pytest.mark.parametrize("decode_num_splits", [None, 2])
def test_backend_prefill_mixed_and_decode_steps(
    decode_num_splits: int | None, poisoned_alloc: None
) -> None:
    gen = torch.Generator().manual_seed(11)
    backend = get_backend("triton")
    backend.decode_num_splits = decode_num_splits
    assert backend.name == "triton"
    kv_cache = torch.randn(
        (NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, HKV, D), generator=gen
    )  # random, never zeros: stale reads would show
    k_cache, v_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]
    block_tables = torch.tensor([[7, 2, 9, 0], [4, 11, 6, 0], [1, 5, 3, 0]], dtype=torch.int32)
    # Each step: (query_lens, seq_lens, padded token count).
    steps = [
        ([17, 16, 1], [17, 16, 1], 36),  # prompts: past a block boundary, exactly one block, one
        ([1, 17, 33], [18, 33, 34], 53),  # decode row + prompt chunks through the extend kernel
        ([1, 1, 1], [19, 34, 35], 4),  # decode-only step, one padded token row
    ]
    for query_lens, seq_lens, num_tokens in steps:
        meta = make_meta(query_lens, seq_lens, block_tables, num_tokens)
        # q, k and v are strided views of one fused projection output, as the model passes them.
        qkv = torch.randn((num_tokens, HQ + 2 * HKV, D), generator=gen)
        q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
        real = sum(query_lens)

        out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)

        valid = meta.slot_mapping >= 0
        slots = meta.slot_mapping[valid]
        assert torch.equal(k_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], k[valid])
        assert torch.equal(v_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], v[valid])
        if meta.is_decode_only:
            expected = paged_decode_attention_ref(
                q[:real], k_cache, v_cache, block_tables, meta.seq_lens, SCALE
            )
        else:
            expected = paged_extend_attention_ref(
                q, k_cache, v_cache, block_tables, meta.query_start_loc, meta.seq_lens, SCALE
            )[:real]
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out[:real], expected, atol=2e-6, rtol=1e-5)
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))


def test_backend_rejects_metadata_with_more_tokens_than_q() -> None:
    backend = get_backend("triton")
    block_tables = torch.tensor([[0, 1]], dtype=torch.int32)
    meta = make_meta([3], [3], block_tables, 3)
    kv_cache = torch.randn((2, 1, 2, BLOCK_SIZE, HKV, D))
    before = kv_cache.clone()
    q = torch.randn((2, HQ, D))
    k = torch.randn((2, HKV, D))
    with pytest.raises(ValueError, match="3 query tokens"):
        backend.forward(q, k, k, kv_cache[:, 0, 0], kv_cache[:, 0, 1], meta, SCALE)
    assert torch.equal(kv_cache, before)
    with pytest.raises(ValueError, match="decode_num_splits"):
        type(backend)(decode_num_splits=0)


def test_torch_backend_fast_paths_match_the_references() -> None:
    """SDPA prefill (with and without a cached prefix, GQA) and the grouped decode path."""
    gen = torch.Generator().manual_seed(12)
    backend = get_backend("torch")
    assert backend.name == "torch"
    kv_cache = torch.randn((NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, HKV, D), generator=gen)
    k_cache, v_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]
    block_tables = torch.tensor([[7, 2, 9, 0], [4, 11, 6, 0], [1, 5, 3, 0]], dtype=torch.int32)
    steps = [([17, 16, 1], [17, 16, 1]), ([1, 17, 33], [18, 33, 34]), ([1, 1, 1], [19, 34, 35])]
    for query_lens, seq_lens in steps:
        num_tokens = sum(query_lens)  # no padding rows: the torch backend runs without graphs
        meta = make_meta(query_lens, seq_lens, block_tables, num_tokens)
        qkv = torch.randn((num_tokens, HQ + 2 * HKV, D), generator=gen)
        q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]

        out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)

        slots = meta.slot_mapping
        assert torch.equal(k_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], k)
        assert torch.equal(v_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], v)
        if meta.is_decode_only:
            expected = paged_decode_attention_ref(
                q, k_cache, v_cache, block_tables, meta.seq_lens, SCALE
            )
        else:
            expected = paged_extend_attention_ref(
                q, k_cache, v_cache, block_tables, meta.query_start_loc, meta.seq_lens, SCALE
            )
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
