"""Kernel 1: scatter the step's new K and V into the paged KV cache.

Called by the Triton attention backend once per layer per step, before attention, so that the
attention kernels read every token (cached prefix and new) from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    check_shape,
)
from tandem.kernels.refs import kv_cache_write_ref

__all__ = ["kv_cache_write", "kv_cache_write_ref"]


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token; it copies all heads of that token for K and V.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # Padded tokens (slot < 0) fold into the mask rather than an early return, so the program
    # stays branch-free; their out-of-range addresses are never dereferenced.
    valid = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot >= 0
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & valid
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    name = "kv_cache_write"
    if k.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"{name}: k must be [T, H, D] and k_cache [blocks, block_size, H, D]")
    num_tokens, num_heads, head_dim = k.shape
    check_shape(name, "v", v, tuple(k.shape))
    check_shape(name, "k_cache", k_cache, (k_cache.shape[0], k_cache.shape[1], num_heads, head_dim))
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    check_shape(name, "slot_mapping", slot_mapping, (num_tokens,))
    check_dtype(name, "k", k, FLOAT_DTYPES)
    for what, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, what, t, (k.dtype,))
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int64, torch.int32))
    for what, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, what, t)
    check_launchable(name, k, v, k_cache, v_cache, slot_mapping)


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] ([T, H, D]) to cache slot slot_mapping[t]; slots < 0 are skipped.

    k_cache/v_cache are [num_blocks, block_size, H, D] views with any strides (the layer views of
    the block-major cache). Slots beyond the cache are the caller's bug, unchecked on device.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_cache_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
