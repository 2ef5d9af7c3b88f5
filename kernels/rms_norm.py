"""Kernel 4: RMSNorm with the residual add fused in.

Called by the model's norm layers on CUDA; the CPU path calls its reference,
:func:`tandem.kernels.refs.rms_norm_ref`.
Rounding follows Hugging Face LlamaRMSNorm: the residual sum is rounded to the model dtype, the
normalisation runs in fp32 and is rounded to the model dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch import FLOAT_DTYPES, check_dtype, check_launchable, check_shape
from tandem.kernels.refs import rms_norm_ref

__all__ = ["rms_norm", "rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < hidden
    x = tl.load(x_ptr + row * stride_x + h, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + h, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + h, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + h, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, H] (or of x + residual) times weight [H].

    Returns (out, new_residual): with a residual, new_residual = x + residual (x's dtype) and out
    normalises it; without one, new_residual is None. Inputs are not modified; outputs are new
    tensors owned by the caller.
    """
    name = "rms_norm"
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    check_dtype(name, "x", x, FLOAT_DTYPES)
    check_shape(name, "weight", weight, (hidden,))
    check_dtype(name, "weight", weight, FLOAT_DTYPES)
    tensors = [x, weight]
    if residual is not None:
        check_shape(name, "residual", residual, (num_tokens, hidden))
        check_dtype(name, "residual", residual, (x.dtype,))
        tensors.append(residual)
    if any(t.stride(-1) != 1 for t in tensors) or not weight.is_contiguous():
        raise ValueError(f"{name}: x, residual and weight need stride 1 in the hidden dimension")
    check_launchable(name, *tensors)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return out, residual_out
    block_h = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        num_warps=min(16, max(1, block_h // 256)),
    )
    return out, residual_out
