"""The attention-backend seam between the model and the paged KV cache.

KV cache layout (owned by the ModelRunner, shared by every backend and by the KV connector):

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block-major, so one block of one request is a single contiguous region across all layers: the KV
connector moves a block with one copy instead of 2 * num_layers. A layer sees strided views
``k_cache = kv_cache[:, layer, 0]`` and ``v_cache = kv_cache[:, layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; kernels must honour their strides.

A token's slot is ``block_id * block_size + offset``; slot -1 marks padding and is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the ModelRunner; read by every layer's backend call.

    Sequences are packed: sequence i owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``.
    Its first ``context_lens[i] = seq_lens[i] - query_len_i`` tokens are already in the cache
    (computed prefix or prefix-cache hit); the query tokens are positions
    ``context_lens[i] .. seq_lens[i]-1`` and attend causally to everything before them.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    context_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], unused entries 0
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop in Python (the torch backend); avoids device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Called by every attention layer on every step, in layer order."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """Write k/v at meta.slot_mapping, then attend; returns [num_tokens, heads, head_dim].

        window > 0 is sliding-window attention (Mistral): a query at position p attends to keys
        p - window < j <= p only. Blocks that fall out of the window stay allocated (the prefix
        cache and the KV connector see whole sequences); they are just not read."""
        ...
