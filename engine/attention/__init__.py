"""Attention backends: how a layer writes new K/V into the paged cache and attends over it.

The interface (``AttentionBackend``, ``AttentionMetadata``) is in :mod:`.backend`, the lookup by
name in :mod:`.registry`, the implementations in :mod:`.torch_backend` and :mod:`.triton_backend`.
"""

from tandem.engine.attention.backend import AttentionBackend, AttentionMetadata
from tandem.engine.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
