"""Triton pieces shared by the paged attention kernels: reading a KV tile through a block table
and the online-softmax update. (Their PyTorch references, with the gather, are in
:mod:`tandem.kernels.refs`.)

A sequence's token at position p lives in physical block ``block_table[p // block_size]`` at offset
``p % block_size``. Kernels tile positions in BLOCK_N steps independent of block_size, so a tile may
span several blocks (block_size < BLOCK_N) or part of one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Finite start for running maxima: a fully masked row then gives exp2(-inf - NEG_BIG) = 0, never
# the NaN that exp2(-inf - -inf) would produce.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
# The kernels work in the log2 domain (exp2 is cheaper than exp): scores are scaled by LOG2E.
LOG2E = math.log2(math.e)


@triton.jit
def load_paged_tile(
    cache_ptr,
    bt_row_ptr,
    pos,
    n_mask,
    kv_head,
    d,
    d_mask,
    block_size,
    stride_b,
    stride_s,
    stride_h,
):
    """Load cache[block_table[pos // block_size], pos % block_size, kv_head, d] as [BLOCK_N, D]."""
    blk = tl.load(bt_row_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    off = (pos % block_size).to(tl.int64)
    ptrs = cache_ptr + blk[:, None] * stride_b + off[:, None] * stride_s + kv_head * stride_h
    return tl.load(ptrs + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 domain, masked entries -inf) and values v [N, D] into the running
    max m_i, denominator l_i and unnormalised output acc (all fp32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 attention must not drop to TF32 on tensor cores; 16-bit inputs keep the default."""
    return "ieee" if dtype == torch.float32 else "tf32"
