"""Pieces shared by the paged attention kernels: reading a KV tile through a block table, the
online-softmax update, and the PyTorch gather used by the references.

A sequence's token at position p lives in physical block ``block_table[p // block_size]`` at offset
``p % block_size``. Kernels tile positions in BLOCK_N steps independent of block_size, so a tile may
span several blocks (block_size < BLOCK_N) or part of one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Finite start for running maxima: a fully masked row then gives exp2(-inf - NEG_BIG) = 0, never
# the NaN that exp2(-inf - -inf) would produce.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


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


def gather_seq_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one sequence's first seq_len tokens into dense [seq_len, H, D] K and V (reference)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table.long()[pos // block_size]
    return k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size]


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """fp32 causal attention of q [M, Hq, D] at absolute positions q_positions over dense k/v
    [L, Hkv, D] at positions 0..L-1, with GQA by repeating KV heads. Returns [M, Hq, D] fp32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), kf) * scale
    allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), vf)
