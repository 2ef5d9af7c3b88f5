"""Rotary position embedding tables, computed exactly as Hugging Face transformers does."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(rot_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (float32) for rope types default, linear and llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def cos_sin_cache(
    rot_dim: int,
    base: float,
    max_position: int,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[max_position, rot_dim]: the first rot_dim/2 columns are cos, the last rot_dim/2 sin."""
    inv_freq = rope_inv_freq(rot_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = t[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def apply_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q [T, Hq, D] and k [T, Hk, D] (out of place)."""
    half = cache.shape[-1] // 2
    cos_sin = cache[positions]
    cos = torch.cat([cos_sin[:, :half]] * 2, dim=-1)[:, None, :]
    sin = torch.cat([cos_sin[:, half:]] * 2, dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rotate(q), rotate(k)
