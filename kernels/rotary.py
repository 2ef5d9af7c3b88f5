"""Kernel 5: rotary position embedding (neox style), applied in place to Q and K.

Called by the model's attention layers on CUDA after the QKV projection, with the cos/sin table
that :func:`tandem.kernels.rope_cache.compute_cos_sin_cache` builds once per model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch import FLOAT_DTYPES, check_dtype, check_launchable, check_shape
from tandem.kernels.refs import rotary_embedding_ref

__all__ = ["rotary_embedding", "rotary_embedding_ref"]


@triton.jit
def _rotate_heads(
    x_ptr,
    t,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (i < HALF)
    ptr1 = x_ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)[None, :]
    c_mask = i < HALF
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + i, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_R)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate the first rot_dim dims of q [T, Hq, D] and k [T, Hk, D] in place by positions [T].

    Neox style: pairs (i, i + rot_dim/2). Math in fp32, one rounding to q's dtype. Positions must be
    < cos_sin_cache.shape[0]; that is the caller's invariant and is not checked on device.
    """
    name = "rotary_embedding"
    if q.dim() != 3 or k.dim() != 3 or cos_sin_cache.dim() != 2:
        raise ValueError(f"{name}: q, k must be [T, H, D] and cos_sin_cache [max_pos, rot_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"{name}: rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    check_shape(name, "k", k, (num_tokens, k.shape[1], head_dim))
    check_shape(name, "positions", positions, (num_tokens,))
    check_dtype(name, "positions", positions, (torch.int64, torch.int32))
    check_dtype(name, "q", q, FLOAT_DTYPES)
    check_dtype(name, "k", k, (q.dtype,))
    check_dtype(name, "cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{name}: q, k and cos_sin_cache need stride 1 in their last dimension")
    check_launchable(name, positions, q, k, cos_sin_cache)
    if num_tokens == 0:
        return
    half = rot_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_R=triton.next_power_of_2(half),
    )
