"""Rotary position embedding for the model: the cos/sin table.

Both halves have one definition in tandem.kernels, pure PyTorch: the table in
:mod:`tandem.kernels.rope_cache` (identical to transformers for default/linear/llama3 scaling) and
the CPU path's rotation, :func:`tandem.kernels.refs.rotary_embedding_ref`, which ``FusedOps``
calls. The model and the loader build the table through this alias.
"""

from __future__ import annotations

from tandem.kernels.rope_cache import compute_cos_sin_cache as cos_sin_cache

__all__ = ["cos_sin_cache"]
