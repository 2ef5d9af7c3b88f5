"""Attention backends: how a layer writes new K/V into the paged cache and attends over it."""

from tandem.engine.attention.backend import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
