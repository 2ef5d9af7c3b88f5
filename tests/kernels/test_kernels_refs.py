"""The single PyTorch references: importable without triton, re-exported (not redefined) by the
kernel modules, and the model's CPU path (FusedOps without kernels) built on them, bit for bit
equal to transformers in bf16. The torch attention backend, which writes and gathers KV with them,
is held to the attention references in test_kernels_triton_backend.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem.kernels as kernels
from tandem.engine.models.llama import FusedOps
from tandem.kernels import refs
from tandem.kernels.rope_cache import compute_cos_sin_cache

# Each Triton module and the reference it re-exports.
REEXPORTS = {
    "activation": "silu_and_mul_ref",
    "decode_attention": "paged_decode_attention_ref",
    "extend_attention": "paged_extend_attention_ref",
    "kv_cache_write": "kv_cache_write_ref",
    "rms_norm": "rms_norm_ref",
    "rotary": "rotary_embedding_ref",
}


def test_refs_and_cpu_path_import_without_triton(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any import of triton now fails
        "import tandem.kernels.refs, tandem.kernels.rope_cache, tandem.kernels.paged_args\n"
        "from tandem.kernels import rms_norm_ref, kv_cache_write_ref\n"
        "import tandem.engine.models.llama\n"
        "from tandem.engine.attention import get_backend\n"
        "assert get_backend('torch').name == 'torch'\n"
    )
    # Not from the repo root, whose operator/ folder would shadow the standard library.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=120)


def test_kernel_modules_reexport_the_single_references() -> None:
    for module, name in REEXPORTS.items():
        ref = getattr(refs, name)
        assert getattr(importlib.import_module(f"tandem.kernels.{module}"), name) is ref
        assert getattr(kernels, name) is ref


def test_kv_cache_write_ref_with_and_without_padding() -> None:
    k = torch.randn((3, 1, 2))
    v = torch.randn((3, 1, 2))
    for slots in ([5, 2, 0], [5, -1, 0]):
        k_cache, v_cache = torch.zeros((2, 4, 1, 2)), torch.zeros((2, 4, 1, 2))
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        for t, slot in enumerate(slots):
            if slot >= 0:
                expected_k[slot // 4, slot % 4], expected_v[slot // 4, slot % 4] = k[t], v[t]
        refs.kv_cache_write_ref(k, v, k_cache, v_cache, torch.tensor(slots))
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_cpu_fused_ops_match_transformers_bit_for_bit_in_bf16() -> None:
    """The CPU path rounds as Hugging Face does in 16-bit dtypes (compute_dtype=x.dtype)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(4)
    dtype, t, hidden, head_dim = torch.bfloat16, 5, 96, 64
    ops = FusedOps(use_kernels=False)

    norm = llama.LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand((hidden,), generator=gen) + 0.5)
    x = torch.randn((t, hidden), generator=gen).to(dtype)
    residual = torch.randn((t, hidden), generator=gen).to(dtype)
    with torch.no_grad():
        out, new_residual = ops.rms_norm(x, norm.weight, 1e-6, residual)
        assert new_residual is not None and torch.equal(new_residual, residual + x)
        assert torch.equal(out, norm(residual + x))

    gate_up = (torch.randn((t, 2 * hidden), generator=gen) * 4).to(dtype)
    gate, up = gate_up[:, :hidden], gate_up[:, hidden:]
    assert torch.equal(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)

    cache = compute_cos_sin_cache(head_dim, 10000.0, 64)
    positions = torch.tensor([0, 3, 63, 17, 1])
    q = torch.randn((t, 4, head_dim), generator=gen).to(dtype)
    k = torch.randn((t, 2, head_dim), generator=gen).to(dtype)
    half = head_dim // 2
    cos = cache[positions, :half].repeat(1, 2).to(dtype)  # HF's [T, D] cos, cast to the dtype
    sin = cache[positions, half:].repeat(1, 2).to(dtype)
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    got_q, got_k = ops.rotary(positions, q.clone(), k.clone(), cache)
    assert torch.equal(got_q, hf_q) and torch.equal(got_k, hf_k)
