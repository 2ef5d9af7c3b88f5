"""Kernel 6: SiLU-and-mul, the gate of the Llama MLP: silu(x[:, :I]) * x[:, I:].

Called by the model's MLP on CUDA with the fused gate_up projection's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch import FLOAT_DTYPES, check_dtype, check_launchable
from tandem.kernels.refs import silu_and_mul_ref

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> new tensor [T, I] = silu(gate) * up, computed in fp32, stored in x's dtype."""
    name = "silu_and_mul"
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"{name}: x must be [T, 2*I], got shape {tuple(x.shape)}")
    check_dtype(name, "x", x, FLOAT_DTYPES)
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x must have stride 1 in its last dimension")
    check_launchable(name, x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block
    )
    return out
