"""RMSNorm (+ residual), rotary embedding, the cos/sin table and SiLU-and-mul against their
references, with poisoned allocations and strided inputs."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_ref
from tandem.kernels.rms_norm import rms_norm, rms_norm_ref
from tandem.kernels.rope_cache import compute_cos_sin_cache, compute_inv_freq
from tandem.kernels.rotary import rotary_embedding, rotary_embedding_ref

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("hidden", [96, 1000])
def test_rms_norm_with_and_without_residual(hidden: int, poisoned_alloc: None) -> None:
    gen = torch.Generator().manual_seed(hidden)
    big = torch.randn((5, hidden + 8), generator=gen) * 3
    x = big[:, :hidden]  # row stride differs from the width
    residual = torch.randn((5, hidden), generator=gen)
    weight = torch.rand((hidden,), generator=gen) + 0.5
    x_before, residual_before = x.clone(), residual.clone()

    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    assert new_residual is not None and torch.equal(new_residual, ref_residual)

    out_plain, none = rms_norm(x, weight, 1e-5)
    assert none is None
    torch.testing.assert_close(out_plain, rms_norm_ref(x, weight, 1e-5)[0], atol=1e-6, rtol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_matches_transformers_fp32() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(1)
    norm = llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand((64,), generator=gen) + 0.5)
    x = torch.randn((3, 64), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, norm.weight.detach(), 1e-5)[0], norm(x))


def test_rotary_embedding_in_place_matches_reference(poisoned_alloc: None) -> None:
    gen = torch.Generator().manual_seed(5)
    num_q, num_k, head_dim = 6, 2, 80
    cache = compute_cos_sin_cache(head_dim, 500000.0, 64, LLAMA3_SCALING)
    positions = torch.tensor([0, 63, 17, 16, 1])
    # q and k are strided views of one fused QKV output.
    qkv = torch.randn((5, num_q + 2 * num_k, head_dim), generator=gen)
    q, k = qkv[:, :num_q], qkv[:, num_q : num_q + num_k]
    original = qkv.clone()
    expected = qkv.clone()
    rotary_embedding(positions, q, k, cache)
    rotary_embedding_ref(positions, expected[:, :num_q], expected[:, num_q : num_q + num_k], cache)
    torch.testing.assert_close(qkv, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[0], original[0])  # position 0 rotates by angle 0
    assert not torch.isclose(qkv[1:, : num_q + num_k], original[1:, : num_q + num_k]).all()
    assert torch.equal(qkv[:, num_q + num_k :], original[:, num_q + num_k :])  # v untouched


def test_partial_rotary_leaves_tail_dims_untouched() -> None:
    gen = torch.Generator().manual_seed(6)
    cache = compute_cos_sin_cache(32, 10000.0, 20)
    q = torch.randn((3, 4, 64), generator=gen)
    k = torch.randn((3, 1, 64), generator=gen)
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.tensor([19, 2, 7], dtype=torch.int32)
    rotary_embedding(positions, q, k, cache)
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding(positions, q[..., :16], k[..., :16], cache)


def _hf_inv_freq(rope_parameters: dict, head_dim: int) -> torch.Tensor:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=16384,
        rope_parameters=rope_parameters,
    )
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        return llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config)[0]


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING],
    ids=["default", "linear", "llama3"],
)
def test_inverse_frequencies_match_transformers(scaling: dict | None) -> None:
    theta = 500000.0
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    params["rope_theta"] = theta
    expected = _hf_inv_freq(params, head_dim=128)
    assert torch.equal(compute_inv_freq(128, theta, scaling), expected)
    cache = compute_cos_sin_cache(128, theta, 9000, scaling)
    angles = torch.arange(9000, dtype=torch.float)[:, None] * expected[None, :]
    assert torch.equal(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))


def test_cos_sin_cache_rejects_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="yarn"):
        compute_cos_sin_cache(64, 10000.0, 8, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="even"):
        compute_inv_freq(63, 10000.0, None)


def test_silu_and_mul_matches_reference(poisoned_alloc: None) -> None:
    gen = torch.Generator().manual_seed(8)
    inter = 1500  # not a power of two, and more than one column block
    big = torch.randn((4, 2 * inter + 3), generator=gen) * 4
    x = big[:, : 2 * inter]
    out = silu_and_mul(x)
    assert out.shape == (4, inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="2\\*I"):
        silu_and_mul(big[:, :7])


def test_the_models_fused_ops_call_the_kernels_after_their_modules_are_imported() -> None:
    """This file imports the module ``tandem.kernels.rms_norm``, which replaces the package's
    lazy export of that name with the module; the model's ``FusedOps`` on the kernel path (CUDA)
    must still call the functions. The first GPU run failed every CUDA engine test on this."""
    from tandem.engine.models.llama import FusedOps

    ops = FusedOps(use_kernels=True)
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn((4, 64), generator=gen), torch.randn((4, 64), generator=gen)
    weight = torch.rand((64,), generator=gen) + 0.5
    out, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    assert new_residual is not None and torch.equal(new_residual, ref_residual)

    gate_up = torch.randn((4, 2 * 48), generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))

    cache = compute_cos_sin_cache(32, 10000.0, 20)
    positions = torch.tensor([0, 3, 7, 19])
    q, k = torch.randn((4, 2, 32), generator=gen), torch.randn((4, 1, 32), generator=gen)
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary(positions, q, k, cache)
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-5)
