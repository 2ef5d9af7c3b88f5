"""Kernel 2: paged decode attention (one query token per sequence), with a split-K variant.

Called by the Triton attention backend for decode-only steps, after kv_cache_write has stored the
step's token, so each sequence attends to cache positions 0..seq_len-1.

One program handles one (sequence, KV head, split) and all query heads of that KV head's group, so
each KV tile is read once for the whole group (GQA/MQA). With NUM_SPLITS > 1 (flash-decoding) the
sequence's tiles are shared among splits, each split writes a partial output with its log-sum-exp,
and a second kernel merges them; this keeps the GPU busy when there are few sequences but long
contexts. Any number of splits is correct for any lengths, so a CUDA graph may fix it.
"""

from __future__ import annotations

import functools

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
from tandem.kernels.refs import paged_decode_attention_ref

__all__ = ["paged_decode_attention", "paged_decode_attention_ref"]


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Sliding window (window > 0): the query at seq_len - 1 sees positions kv_lo..seq_len-1.
    kv_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = kv_lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + n
        n_mask = (pos < seq_len) & (pos >= kv_lo)
        k = load_paged_tile(
            k_cache_ptr, bt_row, pos, n_mask, kv_head, d, d_mask, block_size,
            stride_kb, stride_ks, stride_kh,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        v = load_paged_tile(
            v_cache_ptr, bt_row, pos, n_mask, kv_head, d, d_mask, block_size,
            stride_vb, stride_vs, stride_vh,
        )  # fmt: skip
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    # An empty range (seq_len 0, or a split past the end) leaves l_i = 0: emit zeros, not NaN.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are contiguous fp32 [num_seqs, num_heads, NUM_SPLITS, BLOCK_D] and lse
        # [num_seqs, num_heads, NUM_SPLITS], lse in the log2 domain.
        row = (seq * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    row = (seq * num_heads + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    part = tl.load(
        part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split long contexts until there are about four programs per SM (flash-decoding), keeping
    at least 1024 positions per split, and split in two from 4096 positions even when the batch
    fills the GPU. A power of two (each value is a compiled variant), at most 32.

    From ``benchmarks/decode_tuning_gpu.py`` on an H200 (bf16, Llama-3-8B heads; see
    docs/benchmarks.md): with two programs per SM and no split once the batch filled the GPU,
    batch 64 x 4k context read at 70 % of copy bandwidth; two splits (and two pipeline stages)
    reach 96 %, and every batch from 32 with 4k context or more gained 10-30 %.
    """
    base = max(1, num_seqs * num_kv_heads)
    by_occupancy = triton.cdiv(4 * num_sms, base)
    by_length = max(1, max_seq_len // 1024)
    splits = min(by_occupancy, by_length, 32)
    if max_seq_len >= 4096:
        splits = max(splits, 2)
    return 1 << (splits.bit_length() - 1)  # the power of two at or below


def num_sms(device: torch.device) -> int:
    """``device``'s SM count (the current CUDA device when it has no index), cached."""
    return _num_sms(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _num_sms(device_index: int) -> int:
    # get_device_properties costs ~0.1 ms a call (H200, torch 2.11): per layer and step in eager.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (sequence i's one new token) over cache positions
    0..seq_lens[i]-1 read through block_tables [B, max_blocks]. Returns [B, Hq, D] in q's dtype
    (written into out when given). Sequences with seq_len 0 get zeros. window > 0: sliding-window
    attention over the last ``window`` positions only (Mistral).

    num_splits None picks by occupancy on CUDA (needs max_seq_len, a host int, to avoid a sync) and
    1 in the interpreter. block_n overrides the KV tile (a power of two >= 16); num_warps and
    num_stages override the launch's (4 warps; 2 stages on CUDA when split, else Triton's 3;
    ``benchmarks/decode_tuning_gpu.py`` sweeps them).
    """
    name = "paged_decode_attention"
    check_paged_attention_args(name, q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(name, out, q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        if q.is_cuda and max_seq_len is not None:
            sms = num_sms(q.device)
            num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, sms)
        else:
            num_splits = 1
    if num_splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0, got {window}")
    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 64 if q.is_cuda and block_d <= 128 else 32
    check_tile(name, "block_n", block_n)
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"{name}: num_stages must be >= 1, got {num_stages}")
    if num_stages is None and q.is_cuda and num_splits > 1:
        # The H200 sweep: split, 2 stages are 15-30 % faster than Triton's 3; unsplit, 3 are ~4 %.
        num_stages = 2
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
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
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        **launch,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
