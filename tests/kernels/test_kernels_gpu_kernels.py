"""bf16/fp16 kernels on CUDA against their fp32-computing references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_ref
from tandem.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from tandem.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from tandem.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from tandem.kernels.rms_norm import rms_norm, rms_norm_ref
from tandem.kernels.rope_cache import compute_cos_sin_cache
from tandem.kernels.rotary import rotary_embedding, rotary_embedding_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
# Attention outputs are convex combinations of V (|v| ~ 1): a few ulps of the 16-bit dtype.
ATTN_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Elementwise ops round once from fp32 like their references, but fp32 reduction order and FMA
# contraction may flip that rounding: allow one 16-bit ulp.
ULP = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _cache(dtype: torch.dtype, block_size: int, hkv: int, d: int) -> torch.Tensor:
    return torch.randn((128, 3, 2, block_size, hkv, d), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(32, 8, 128, 16), (28, 4, 80, 32), (8, 1, 64, 16)])
def test_paged_attention_16bit(
    dtype: torch.dtype, hq: int, hkv: int, d: int, block_size: int
) -> None:
    torch.manual_seed(0)
    kv_cache = _cache(dtype, block_size, hkv, d)
    k_cache, v_cache = kv_cache[:, 2, 0], kv_cache[:, 2, 1]
    seq_lens = [1, 15, 16, 17, 32, 33, 300, 511]
    width = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(128, device="cuda")
    tables = torch.stack(
        [perm[(i * 13) % 100 : (i * 13) % 100 + width] for i in range(len(seq_lens))]
    ).int()
    # Random tables may share blocks across rows: harmless for attention-only checks.
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn((len(seq_lens), hq, d), device="cuda", dtype=dtype)
    scale = d**-0.5
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    for splits in (1, 4, None):
        out = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, num_splits=splits, max_seq_len=511
        )
        torch.testing.assert_close(out, expected, atol=ATTN_TOL[dtype], rtol=0)

    query_lens = [1, 15, 16, 5, 32, 1, 200, 100]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device="cuda").int()
    qx = torch.randn((int(starts[-1]), hq, d), device="cuda", dtype=dtype)
    expected = paged_extend_attention_ref(qx, k_cache, v_cache, tables, starts, lens, scale)
    out = paged_extend_attention(qx, k_cache, v_cache, tables, starts, lens, 200, scale)
    torch.testing.assert_close(out, expected, atol=ATTN_TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_16bit(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    kv_cache = _cache(dtype, 16, 8, 128)
    expected = kv_cache.clone()
    k = torch.randn((40, 8, 128), device="cuda", dtype=dtype)
    slots = torch.randperm(128 * 16, device="cuda")[:40]
    slots[::7] = -1
    kv_cache_write(k, k, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots)
    kv_cache_write_ref(k, k, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(kv_cache, expected)

    x = torch.randn((33, 4096), device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(4096, device="cuda", dtype=dtype) + 0.5
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert new_residual is not None and torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=ULP[dtype])

    gate_up = torch.randn((33, 2 * 11008), device="cuda", dtype=dtype)
    torch.testing.assert_close(
        silu_and_mul(gate_up), silu_and_mul_ref(gate_up), atol=1e-5, rtol=ULP[dtype]
    )

    cache = compute_cos_sin_cache(128, 500000.0, 4096, None).cuda()
    positions = torch.randint(0, 4096, (33,), device="cuda")
    q = torch.randn((33, 32, 128), device="cuda", dtype=dtype)
    kk = torch.randn((33, 8, 128), device="cuda", dtype=dtype)
    q_ref, k_ref = q.clone(), kk.clone()
    rotary_embedding(positions, q, kk, cache)
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-3, rtol=ULP[dtype])
    torch.testing.assert_close(kk, k_ref, atol=1e-3, rtol=ULP[dtype])
