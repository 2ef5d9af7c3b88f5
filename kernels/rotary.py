"""Kernel 5: rotary position embedding (neox style), applied in place to Q and K.

Called by the model's attention layers on CUDA after the QKV projection. The cos/sin table is built
once per model by :func:`compute_cos_sin_cache` with Hugging Face's inverse frequencies (plain,
"linear" and "llama3" scaling), so the Triton and PyTorch paths agree with transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from tandem.kernels.launch import FLOAT_DTYPES, check_dtype, check_launchable, check_shape


def compute_inv_freq(
    rot_dim: int, base: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """fp32 inverse frequencies [rot_dim // 2], as transformers' ROPE_INIT_FUNCTIONS compute them.

    rope_scaling: None (or rope_type "default"), {"rope_type": "linear", "factor"} or
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; the key "type" is accepted for "rope_type" as in old
    configs. Anything else raises ValueError.
    """
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float) / rot_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        ramp = high_freq_factor - low_freq_factor
        smooth = (old_context_len / wavelen - low_freq_factor) / ramp
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}: expected default, linear or llama3")


def compute_cos_sin_cache(
    rot_dim: int,
    base: float,
    max_position: int,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[max_position, rot_dim]: columns [0, rot_dim/2) hold cos, [rot_dim/2, rot_dim) sin.

    Angles are computed in fp32 like transformers (position * inv_freq), then cast to dtype.
    """
    inv_freq = compute_inv_freq(rot_dim, base, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


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


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """PyTorch reference of :func:`rotary_embedding` (in place, fp32 math)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
