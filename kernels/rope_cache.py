"""The rotary cos/sin table, with Hugging Face's inverse frequencies (plain, "linear" and "llama3"
scaling) so the Triton and PyTorch paths agree with transformers. Pure PyTorch: the CPU model path
uses it without triton.
"""

from __future__ import annotations

import math
from typing import Any

import torch


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
