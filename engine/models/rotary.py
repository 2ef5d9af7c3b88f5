"""Rotary position embedding: the cos/sin table (one definition, in tandem.kernels.rope_cache:
pure PyTorch, identical to transformers for default/linear/llama3 scaling) and the PyTorch
rotation the CPU path uses."""

from __future__ import annotations

import torch

from tandem.kernels.rope_cache import compute_cos_sin_cache as cos_sin_cache

__all__ = ["apply_rotary_ref", "cos_sin_cache"]


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
