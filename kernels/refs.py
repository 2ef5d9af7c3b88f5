"""The PyTorch references of the kernels: one definition each, pure PyTorch (no triton import), so
a CPU-only install can use them.

Two kinds of callers. The kernel tests (and ``benchmarks/kernels_gpu.py``) hold each Triton kernel
to its reference; the Triton modules re-export their reference for them. The CPU path runs on them:
the torch attention backend writes and gathers paged KV with :func:`kv_cache_write_ref` and
:func:`gather_seq_kv_ref`, and the model's ``FusedOps`` calls :func:`rms_norm_ref`,
:func:`silu_and_mul_ref` and :func:`rotary_embedding_ref` when kernels are off. A reference is
therefore correct and simple, but not slow on purpose.

Paged KV layout, as the kernels read it: a layer's cache is ``[num_blocks, block_size, H, D]`` (any
strides); a token's slot is ``block * block_size + offset`` (slot -1 is padding), and a sequence's
position p lives in block ``block_table[p // block_size]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "argmax_ref",
    "attention_ref",
    "gather_seq_kv_ref",
    "kv_cache_write_ref",
    "linear_ref",
    "paged_decode_attention_ref",
    "paged_extend_attention_ref",
    "rms_norm_ref",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
]


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Each row's largest entry's index (int64): the first of equal ones, the first NaN where
    there is one. Reference of :func:`tandem.kernels.cpu_ops.cpu_argmax`; the sampler's greedy
    rows take it where the CPU kernels are off (or on another device)."""
    return x.argmax(dim=-1)


def kv_cache_write_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] ([T, H, D]) to cache slot slot_mapping[t]; slots < 0 are padding, skipped.

    Reference of :func:`tandem.kernels.kv_cache_write.kv_cache_write`; the torch attention backend
    calls it once per layer per step.
    """
    keep = slot_mapping >= 0
    # Masking copies k and v, so only pay for it when there is padding (CUDA-graph batches).
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def gather_seq_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first seq_len tokens as dense [seq_len, H, D] K and V.

    Called by the attention references below and by the torch backend's prefill path.
    """
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    # Whole blocks are gathered and then trimmed: one indexed copy per block, not per token.
    blocks = block_table[:num_blocks].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]

    return gather(k_cache), gather(v_cache)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """fp32 causal attention of q [M, Hq, D] at absolute positions q_positions over dense k/v
    [L, Hkv, D] at positions 0..L-1, with GQA by repeating KV heads. Returns [M, Hq, D] fp32.

    window > 0 is sliding-window attention as in Hugging Face's Mistral: a query at position p
    sees keys j with p - window < j <= p."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), kf) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = k_pos <= q_positions[:, None]
    if window > 0:
        allowed &= k_pos > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), vf)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Reference of :func:`tandem.kernels.decode_attention.paged_decode_attention` (gathers each
    sequence's KV); sequences with seq_len 0 get zeros. window: as in :func:`attention_ref`."""
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_seq_kv_ref(k_cache, v_cache, block_tables[i], seq_len)
        pos = torch.tensor([seq_len - 1], device=q.device)
        out[i] = attention_ref(q[i : i + 1], k, v, pos, scale, window)[0].to(q.dtype)
    return out


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Reference of :func:`tandem.kernels.extend_attention.paged_extend_attention`; rows past the
    last query are zero. window: as in :func:`attention_ref`."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k, v = gather_seq_kv_ref(k_cache, v_cache, block_tables[i], seq_len)
        pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        out[lo:hi] = attention_ref(q[lo:hi], k, v, pos, scale, window).to(q.dtype)
    return out


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N], as ``nn.Linear`` computes it.
    Reference of :func:`tandem.kernels.cpu_ops.cpu_linear`."""
    return F.linear(x, weight, bias)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, H] (or of x + residual) times weight [H], with Hugging Face LlamaRMSNorm's
    rounding: the residual sum is rounded to x's dtype, the normalisation runs in fp32 and is
    rounded to x's dtype, then multiplied by the weight. Returns (out, new_residual), the latter
    None without a residual. Reference of :func:`tandem.kernels.rms_norm.rms_norm`."""
    new_residual = None
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        new_residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype), new_residual


def silu_and_mul_ref(
    x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x [..., 2I] -> [..., I] = silu(x[..., :I]) * x[..., I:], in x's dtype.

    compute_dtype float32 is the kernel's arithmetic (one rounding; reference of
    :func:`tandem.kernels.activation.silu_and_mul`). The CPU model path passes x's dtype, which
    rounds after each op as Hugging Face's MLP does; in fp32 the two are the same.
    """
    inter = x.shape[-1] // 2
    xc = x.to(compute_dtype)
    return (F.silu(xc[..., :inter]) * xc[..., inter:]).to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Rotate the first rot_dim dims of q [T, Hq, D] and k [T, Hk, D] in place by positions [T].

    Neox style: pairs (i, i + rot_dim/2); cos_sin_cache is [max_pos, rot_dim], cos then sin.
    compute_dtype float32 is the kernel's arithmetic (one rounding; reference of
    :func:`tandem.kernels.rotary.rotary_embedding`). The CPU model path passes q's dtype, which
    rounds cos/sin and each op to it as Hugging Face's rotation does; in fp32 the two are the same.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].to(compute_dtype)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        a, b = x1.to(compute_dtype), x2.to(compute_dtype)  # views when compute_dtype is x's
        # Both halves are computed before either is written back; copy_ rounds to x's dtype.
        new1, new2 = a * cos - b * sin, b * cos + a * sin
        x1.copy_(new1)
        x2.copy_(new2)
