"""Kernel 3: prefill/extend attention over the paged KV cache.

Called by the Triton attention backend for steps that contain prefill chunks (or mixed batches),
after kv_cache_write has stored the step's tokens. Sequence i's query tokens are packed at
``query_start_loc[i]:query_start_loc[i+1]``; they sit at absolute positions
``context_len .. seq_len-1`` (context_len = seq_len - query_len, the cached prefix from earlier
chunks or prefix-cache hits) and attend causally to cache positions up to their own. A decode token
is simply a query of length 1, so mixed batches run through this kernel unchanged.

One program handles one (query tile, sequence, KV head). Its BLOCK_M rows are (token, group head)
pairs, token-major, so every KV tile is loaded once for all query heads sharing it (GQA/MQA).
Positions below the tile's first query position need no causal mask and are processed in an
unmasked loop; only the diagonal tiles are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.paged_args import check_out, check_paged_attention_args, check_tile
from tandem.kernels.paged_kv import (
    LOG2E,
    NEG_BIG,
    dot_precision,
    load_paged_tile,
    softmax_update,
)
from tandem.kernels.refs import paged_extend_attention_ref

__all__ = ["paged_extend_attention", "paged_extend_attention_ref"]


@triton.jit
def _paged_extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    block_size,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_ptr + seq + 1) - q_start).to(tl.int32)
    tok_lo = tile * TOKENS_PER_TILE
    # The grid covers the longest query; tiles past this sequence's end have nothing to do.
    if tok_lo < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len
        r = tl.arange(0, BLOCK_M)
        tok = tok_lo + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_mask = (r < TOKENS_PER_TILE * GROUP) & (tok < q_len)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        n = tl.arange(0, BLOCK_N)
        io_mask = row_mask[:, None] & d_mask[None, :]
        row_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + row_off, mask=io_mask, other=0.0)
        q_pos = context_len + tok

        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = block_tables_ptr + seq * stride_bt
        # Every row of this tile may see all positions below its first query position.
        unmasked_end = (context_len + tok_lo) // BLOCK_N * BLOCK_N
        masked_start = unmasked_end
        if HAS_WINDOW:
            # Sliding window: rows see different ranges, so every tile is masked, from the tile
            # holding the first position the tile's first row still sees.
            masked_start = tl.maximum(context_len + tok_lo - window + 1, 0) // BLOCK_N * BLOCK_N
            unmasked_end = 0
        kv_end = tl.minimum(seq_len, context_len + tok_lo + TOKENS_PER_TILE)
        all_n = n < BLOCK_N
        for start in range(0, unmasked_end, BLOCK_N):
            pos = start + n
            k = load_paged_tile(
                k_cache_ptr, bt_row, pos, all_n, kv_head, d, d_mask, block_size,
                stride_kb, stride_ks, stride_kh,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            v = load_paged_tile(
                v_cache_ptr, bt_row, pos, all_n, kv_head, d, d_mask, block_size,
                stride_vb, stride_vs, stride_vh,
            )  # fmt: skip
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)
        for start in range(masked_start, kv_end, BLOCK_N):
            pos = start + n
            n_mask = pos < kv_end
            k = load_paged_tile(
                k_cache_ptr, bt_row, pos, n_mask, kv_head, d, d_mask, block_size,
                stride_kb, stride_ks, stride_kh,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                causal = causal & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(causal, s, float("-inf"))
            v = load_paged_tile(
                v_cache_ptr, bt_row, pos, n_mask, kv_head, d, d_mask, block_size,
                stride_vb, stride_vs, stride_vh,
            )  # fmt: skip
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of packed queries q [T, Hq, D] over each sequence's cache positions;
    window > 0 restricts a query at position p to keys p - window < j <= p (Mistral).

    max_query_len is a host int (sizes the grid without a device sync) and must be >= every query
    length. Rows of q beyond query_start_loc[-1] are not written. Returns [T, Hq, D] in q's dtype
    (into out when given). block_m/block_n override the tiles (powers of two >= 16).
    """
    name = "paged_extend_attention"
    check_paged_attention_args(
        name, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc=query_start_loc
    )
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(name, out, q)
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0, got {window}")
    if num_seqs == 0 or max_query_len <= 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    if block_m is None:
        block_m = 64 if q.is_cuda else 16
    if block_n is None:
        block_n = 64 if q.is_cuda and block_d <= 128 else 32 if q.is_cuda else 16
    block_m = max(block_m, triton.next_power_of_2(group))
    check_tile(name, "block_m", block_m)
    check_tile(name, "block_n", block_n)
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(max_query_len, tokens_per_tile), num_seqs, num_kv_heads)
    _paged_extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.shape[1],
        window,
        GROUP=group,
        HEAD_DIM=head_dim,
        HAS_WINDOW=window > 0,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out
