"""The PyTorch attention backend: the CPU path and the reference the Triton backend is held to."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.backend import AttentionMetadata


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, H, D] into the paged caches at slot_mapping; slots < 0 are padding."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] cache -> [length, H, D] for one sequence's block table."""
    bs = cache.shape[1]
    nblocks = -(-length // bs)
    return cache[block_table[:nblocks]].reshape(nblocks * bs, *cache.shape[2:])[:length]


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + qlen
            keys = _gather(k_cache, meta.block_tables[i], slen)
            vals = _gather(v_cache, meta.block_tables[i], slen)
            out[start:end] = self._attend(q[start:end], keys, vals, slen - qlen, scale)
            start = end
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, context: int, scale: float
    ) -> torch.Tensor:
        """Causal attention of q [Lq, Hq, D] at positions context.. over keys [S, Hk, D]."""
        qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
        if context == 0:
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(context, context + q.shape[0], device=q.device)
            mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return o.transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: gather every sequence's blocks once, pad, mask, one SDPA."""
        bs = k_cache.shape[1]
        nblocks = -(-meta.max_seq_len // bs)
        table = meta.block_tables[:, :nblocks]
        b = q.shape[0]
        keys = k_cache[table].reshape(b, nblocks * bs, *k_cache.shape[2:]).transpose(1, 2)
        vals = v_cache[table].reshape(b, nblocks * bs, *v_cache.shape[2:]).transpose(1, 2)
        mask = torch.arange(nblocks * bs, device=q.device)[None, :] < meta.seq_lens[:, None]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys,
            vals,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]
