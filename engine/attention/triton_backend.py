"""The Triton attention backend: paged KV write plus fused paged attention kernels.

Selected with attention_backend="triton" (the default on CUDA). Each attention layer calls
:meth:`TritonAttentionBackend.forward` once per step: kv_cache_write stores the step's K/V at
meta.slot_mapping, then decode-only steps run paged decode attention (optionally split-K) and any
step with a prefill chunk runs the extend kernel, which also serves the decode rows of a mixed
batch. Nothing is gathered into padded tensors. Runs on CUDA, or on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.backend import AttentionMetadata
from tandem.kernels.decode_attention import paged_decode_attention
from tandem.kernels.extend_attention import paged_extend_attention
from tandem.kernels.kv_cache_write import kv_cache_write


class TritonAttentionBackend:
    """Stateless apart from its options; safe to share across layers and steps.

    decode_num_splits fixes the split-K factor of decode attention (a CUDA graph captured with a
    fixed value stays correct for any lengths); None chooses it per step from meta.max_seq_len.
    """

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        if decode_num_splits is not None and decode_num_splits < 1:
            raise ValueError(f"decode_num_splits must be >= 1 or None, got {decode_num_splits}")
        self.decode_num_splits = decode_num_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """Write k/v at meta.slot_mapping, then attend; returns [num_tokens, num_heads, head_dim].

        Token rows beyond the batch's real query tokens (padding for a CUDA graph) come back zero.
        """
        num_tokens = q.shape[0]
        num_seqs = meta.num_seqs
        num_query_tokens = sum(meta.query_lens_cpu)
        if num_query_tokens > num_tokens:
            raise ValueError(
                f"metadata describes {num_query_tokens} query tokens but q has {num_tokens}"
            )
        kv_cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.is_decode_only:
            paged_decode_attention(
                q[:num_seqs],
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out=out[:num_seqs],
                num_splits=self.decode_num_splits,
                max_seq_len=meta.max_seq_len,
                window=window,
            )
        else:
            paged_extend_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_query_len,
                scale,
                out=out,
                window=window,
            )
        if num_query_tokens < num_tokens:
            out[num_query_tokens:].zero_()
        return out
