"""The PyTorch attention backend: the CPU path and the reference the Triton backend is held to.

On CPU with float32 it runs the CPU kernels (:mod:`tandem.kernels.cpu_ops`: the KV write, then
paged attention read straight through the block table, decode and extend alike, one call per
layer), when they could be built. Otherwise (no compiler, another dtype or device,
``cpu_kernels=False``) writing and gathering paged KV use the kernels' references
(:mod:`tandem.kernels.refs`, pure PyTorch) and attention has its earlier fast paths (SDPA for
prefill chunks, grouped batched matmuls for decode); tests hold both to ``attention_ref``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.backend import AttentionMetadata
from tandem.kernels import cpu_ops
from tandem.kernels.refs import gather_seq_kv_ref, kv_cache_write_ref


class TorchAttentionBackend:
    """``cpu_kernels``: use the CPU kernels where they apply and could be built (the default);
    False keeps the PyTorch path (tests compare the two)."""

    name = "torch"

    def __init__(self, cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels and cpu_ops.available()

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
        if self.cpu_kernels and q.dtype == torch.float32 and q.device.type == "cpu":
            return self._native(q, k, v, k_cache, v_cache, meta, scale, window)
        kv_cache_write_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale, window)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + qlen
            keys, vals = gather_seq_kv_ref(k_cache, v_cache, meta.block_tables[i], slen)
            out[start:end] = self._attend(q[start:end], keys, vals, slen - qlen, scale, window)
            start = end
        return out

    @staticmethod
    def _native(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        cpu_ops.cpu_kv_cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        # Decode rows are one per sequence; anything else (or padding rows) goes by query_start_loc.
        one_row_each = meta.is_decode_only and q.shape[0] == meta.num_seqs
        qsl = None if one_row_each else meta.query_start_loc
        return cpu_ops.cpu_paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, qsl, window=window
        )

    @staticmethod
    def _attend(
        q: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        context: int,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """Causal attention of q [Lq, Hq, D] at positions context.. over keys [S, Hk, D]."""
        group = q.shape[1] // keys.shape[1]
        if group > 1:
            # SDPA's GQA mode takes the slow math path on CPU; repeating K/V keeps the flash one.
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
        qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
        if context == 0 and (window <= 0 or window >= keys.shape[0]):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(context, context + q.shape[0], device=q.device)
            k_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
            mask = k_pos <= q_pos[:, None]
            if window > 0:
                mask &= k_pos > q_pos[:, None] - window
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """One query per sequence. Sequences are grouped by length so each group is gathered and
        padded only to its own longest member (mixed lengths would otherwise pad every row to the
        batch's longest), and each group is one batched matmul-softmax-matmul: with a single
        query row that is cheaper on CPU than the tiled flash kernel."""
        out = torch.empty_like(q)
        bs = k_cache.shape[1]
        lens = meta.seq_lens_cpu
        order = sorted(range(len(lens)), key=lens.__getitem__)
        hkv = k_cache.shape[2]
        b_all, hq, d = q.shape
        group = hq // hkv
        for start in range(0, len(order), _DECODE_GROUP):
            rows = order[start : start + _DECODE_GROUP]
            idx = torch.tensor(rows, device=q.device)
            nblocks = -(-lens[rows[-1]] // bs)
            n, span = len(rows), nblocks * bs
            table = meta.block_tables[idx, :nblocks]
            keys = k_cache[table].reshape(n, span, hkv, d)
            vals = v_cache[table].reshape(n, span, hkv, d)
            qg = q[idx].reshape(n, hkv, group, d)
            span_pos = torch.arange(span, device=q.device)[None, :]
            masked = span_pos >= meta.seq_lens[idx, None]
            if window > 0:
                masked |= span_pos <= meta.seq_lens[idx, None] - 1 - window
            og = torch.empty_like(qg)
            # One batched matmul per KV head reads the gathered keys in place (strided rows), so
            # nothing is transposed into a second copy.
            for h in range(hkv):
                scores = torch.bmm(qg[:, h], keys[:, :, h].transpose(1, 2)).mul_(scale)
                scores.masked_fill_(masked[:, None, :], float("-inf"))
                probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
                og[:, h] = torch.bmm(probs, vals[:, :, h])
            out[idx] = og.reshape(n, hq, d)
        return out


# Decode rows per gathered group: small enough that lengths within a group are close, large
# enough that each matmul still batches well.
_DECODE_GROUP = 16
