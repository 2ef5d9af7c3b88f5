"""The CPU kernels (tandem.kernels.cpu_ops) against the same references the Triton kernels are held
to, edge shapes included, plus their argument checks, the build cache and the forced fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_cases import (
    ATOL,
    CHUNKS,
    HEADS,
    HEADS_IDS,
    LAYER,
    RTOL,
    WINDOW_CASES,
    Heads,
    make_block_tables,
    make_kv_cache,
    pack_chunks,
)

from tandem.kernels import cpu_build, cpu_ops
from tandem.kernels.refs import (
    argmax_ref,
    kv_cache_write_ref,
    linear_ref,
    paged_decode_attention_ref,
    paged_extend_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from tandem.kernels.rope_cache import compute_cos_sin_cache

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU kernels could not be built")

# GQA groups 1..8 (HEADS has 1, 3, 4, 8) and every head dim 32/64/80/96/128. Head dim 32 is
# the benchmarks' model (group 4: query heads scored in pairs) and group 3 leaves one head over.
CPU_HEADS = [*HEADS, Heads(4, 2, 64, 16), Heads(10, 2, 80, 16), Heads(12, 2, 96, 16),
             Heads(14, 2, 128, 32), Heads(8, 8, 128, 16), Heads(8, 2, 32, 16),
             Heads(3, 1, 32, 32)]  # fmt: skip
CPU_IDS = [
    *HEADS_IDS,
    *(f"hq{h.num_heads}-hkv{h.num_kv_heads}-d{h.head_dim}" for h in CPU_HEADS[4:]),
]
SEQ_LENS = [1, 15, 16, 17, 32, 33, 70, 0]


def _decode_case(heads: Heads, seed: int, num_blocks: int = 24):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = make_kv_cache(heads, num_blocks, gen)
    tables = make_block_tables(SEQ_LENS, heads.block_size, num_blocks, gen)
    q = torch.randn((len(SEQ_LENS), heads.num_heads, heads.head_dim), generator=gen)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return q, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], tables, lens


@pytest.mark.parametrize("heads", CPU_HEADS, ids=CPU_IDS)
def test_decode_matches_reference(heads: Heads, poisoned_alloc: None) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(heads, heads.head_dim + heads.num_heads)
    scale = heads.head_dim**-0.5
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    out = cpu_ops.cpu_paged_attention(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # seq_len 0: zeros, not NaN
    # int64 index tensors are accepted too (converted, same result).
    out64 = cpu_ops.cpu_paged_attention(q, k_cache, v_cache, tables.long(), lens.long(), scale)
    torch.testing.assert_close(out64, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", CPU_HEADS, ids=CPU_IDS)
def test_extend_matches_reference_and_zeroes_padding_rows(heads: Heads) -> None:
    gen = torch.Generator().manual_seed(heads.head_dim * 7 + heads.num_kv_heads)
    starts, lens, seq_lens = pack_chunks(CHUNKS)
    kv_cache = make_kv_cache(heads, 24, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    tables = make_block_tables(seq_lens, heads.block_size, 24, gen)
    num_query = int(starts[-1])
    q = torch.randn((num_query + 3, heads.num_heads, heads.head_dim), generator=gen)
    scale = heads.head_dim**-0.5
    expected = paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, scale)
    out = torch.full_like(q, float("nan"))
    cpu_ops.cpu_paged_attention(q, k_cache, v_cache, tables, lens, scale, starts, out=out)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)  # padding rows: zeros


def test_a_long_prompt_spans_several_query_tiles() -> None:
    """100 new tokens after 37 cached (query tiles of 16 rows, keys in chunks of 32)."""
    heads = Heads(8, 2, 64, 16)
    gen = torch.Generator().manual_seed(11)
    kv_cache = make_kv_cache(heads, 16, gen)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    tables = make_block_tables([137], 16, 16, gen)
    starts = torch.tensor([0, 100], dtype=torch.int32)
    lens = torch.tensor([137], dtype=torch.int32)
    q = torch.randn((100, 8, 64), generator=gen)
    expected = paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.125)
    out = cpu_ops.cpu_paged_attention(q, k_cache, v_cache, tables, lens, 0.125, starts)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", WINDOW_CASES)
def test_sliding_window_decode_and_extend(window: int) -> None:
    heads = Heads(8, 2, 64, 16)
    q, k_cache, v_cache, tables, lens = _decode_case(heads, window)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, window)
    out = cpu_ops.cpu_paged_attention(q, k_cache, v_cache, tables, lens, 0.125, window=window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    gen = torch.Generator().manual_seed(window + 1)
    starts, lens, seq_lens = pack_chunks(CHUNKS)
    tables = make_block_tables(seq_lens, 16, 24, gen)
    q = torch.randn((int(starts[-1]), 8, 64), generator=gen)
    expected = paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.125, window)
    got = cpu_ops.cpu_paged_attention(
        q, k_cache, v_cache, tables, lens, 0.125, starts, window=window
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_cache_write_skips_padding_on_strided_views(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    heads = Heads(8, 2, 80, block_size)
    kv_cache = make_kv_cache(heads, 6, gen)
    expected = kv_cache.clone()
    qkv = torch.randn((7, 12, 80), generator=gen)  # k, v: strided views of a fused projection
    k, v = qkv[:, 8:10], qkv[:, 10:]
    last = 6 * block_size - 1
    slots = torch.tensor([0, -1, block_size - 1, block_size, 3 * block_size + 5, last, -1])
    cpu_ops.cpu_kv_cache_write(k, v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    kv_cache_write_ref(k, v, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_pointwise_kernels_match_their_references(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn((rows, 96), generator=gen), torch.randn((rows, 96), generator=gen)
    w = torch.randn(96, generator=gen)
    for residual in (None, res):
        out, new_res = cpu_ops.cpu_rms_norm(x, w, 1e-6, residual)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-6, residual)
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
        assert (new_res is None) == (residual is None)
        if new_res is not None:
            assert torch.equal(new_res, ref_res)
    gate_up = torch.randn((rows, 2 * 172), generator=gen)
    torch.testing.assert_close(
        cpu_ops.cpu_silu_and_mul(gate_up), silu_and_mul_ref(gate_up), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 262, 4096])
def test_argmax_matches_torch_on_ties_nans_and_strided_rows(cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn((9, cols), generator=gen)
    x[1] = -torch.inf  # every entry the same: the first
    x[2, :] = 1.0
    x[3, cols // 2 :] = 50.0  # a tie for the max: the first of it
    x[4, cols - 1] = 1e30  # the max in the scalar tail
    x[5, cols // 3] = torch.nan  # a NaN wins, as in torch.argmax
    x[6, 0] = torch.nan
    x[6, cols - 1] = torch.nan
    x[7] = torch.finfo(torch.float32).min
    x[8] = -0.0
    x[8, cols - 1] = 0.0  # -0.0 == 0.0: the first
    assert torch.equal(cpu_ops.cpu_argmax(x), argmax_ref(x))
    wide = torch.randn((5, cols + 3), generator=gen)
    view = wide[:, 1 : cols + 1]  # rows cols + 3 apart
    assert torch.equal(cpu_ops.cpu_argmax(view), argmax_ref(view))
    assert cpu_ops.cpu_argmax(torch.empty((0, cols))).shape == (0,)


def test_argmax_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"cpu_argmax: x must be \[B, V\] with V > 0"):
        cpu_ops.cpu_argmax(torch.zeros((3, 0)))
    with pytest.raises(ValueError, match="cpu_argmax: x must be"):
        cpu_ops.cpu_argmax(torch.zeros(5))
    with pytest.raises(ValueError, match="cpu_argmax"):
        cpu_ops.cpu_argmax(torch.zeros((2, 4), dtype=torch.float64))
    with pytest.raises(ValueError, match="stride 1"):
        cpu_ops.cpu_argmax(torch.zeros((4, 2)).t())


def test_silu_and_mul_over_the_whole_range_of_its_input() -> None:
    # Eight lanes at a time take sigmoid from exp(-|x|); both signs, zeros, tiny and huge
    # magnitudes (where exp saturates) and a tail shorter than a vector (width 21).
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5, -0.5, 3.0, -3.0, 20.0,
                         -20.0, 87.0, -87.0, 88.5, -88.5, 100.0, -100.0, 1e4, -1e4,
                         7.25])  # fmt: skip
    up = torch.linspace(-2.0, 2.0, gate.numel())
    x = torch.cat([gate, up]).repeat(3, 1)
    torch.testing.assert_close(cpu_ops.cpu_silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("rows", [0, 1, 3, cpu_ops.LINEAR_MAX_ROWS, cpu_ops.LINEAR_MAX_ROWS + 1])
def test_linear_matches_reference_on_edge_shapes(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    # Output counts around the kernel's 4-row tiles, inputs around its 8 lanes; the decode
    # step's shapes (qkv 384 x 256, down 256 x 688) and a vocabulary that is not a multiple of 4.
    for n, k in [(1, 1), (3, 7), (4, 8), (5, 13), (7, 9), (384, 256), (256, 688), (4099, 64)]:
        wide = torch.randn((rows, k + 3), generator=gen)
        x = wide[:, 1 : k + 1]  # a row stride that is not k
        w, b = torch.randn((n, k), generator=gen), torch.randn(n, generator=gen)
        for bias in (None, b):
            got = cpu_ops.cpu_linear(x, w, bias)
            assert got.shape == (rows, n) and got.dtype is torch.float32
            # As close to the exact product as torch's own float32 product is.
            exact = linear_ref(x.double(), w.double(), None if bias is None else bias.double())
            blas_err = (linear_ref(x, w, bias).double() - exact).abs().max().item() if rows else 0
            tol = 4 * blas_err + 1e-6 * k**0.5
            torch.testing.assert_close(got.double(), exact, atol=tol, rtol=0)


def test_linear_refuses_bad_arguments() -> None:
    x, w = torch.randn((2, 8)), torch.randn((5, 8))
    with pytest.raises(ValueError, match="x must be \\[T, K\\] and weight \\[N, K\\]"):
        cpu_ops.cpu_linear(x, torch.randn((5, 7)))
    with pytest.raises(ValueError, match="weight must be contiguous"):
        cpu_ops.cpu_linear(x, torch.randn((10, 8))[::2])
    with pytest.raises(ValueError, match="bias must have shape \\(5,\\)"):
        cpu_ops.cpu_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="cpu_linear: weight must have dtype"):
        cpu_ops.cpu_linear(x, w.double())
    with pytest.raises(ValueError, match="stride 1"):
        cpu_ops.cpu_linear(torch.randn((8, 2)).t(), w)


@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (80, 80), (128, 64)])
def test_rotary_on_strided_views_matches_reference(head_dim: int, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    cache = compute_cos_sin_cache(rot_dim, 10000.0, 256, None)
    qkv = torch.randn((9, (8 + 2 + 2) * head_dim), generator=gen)
    q = qkv[:, : 8 * head_dim].view(9, 8, head_dim)
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(9, 2, head_dim)
    positions = torch.tensor([0, 1, 15, 16, 17, 100, 200, 254, 255])
    want_q, want_k = q.clone(), k.clone()
    rotary_embedding_ref(positions, want_q, want_k, cache)
    before_v = qkv[:, 10 * head_dim :].clone()
    cpu_ops.cpu_rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, 10 * head_dim :], before_v)  # v untouched


def test_wrappers_refuse_bad_arguments_before_touching_memory() -> None:
    heads = Heads(4, 2, 64, 16)
    q, k_cache, v_cache, tables, lens = _decode_case(heads, 0, num_blocks=16)
    before = k_cache.clone()
    attn = cpu_ops.cpu_paged_attention
    with pytest.raises(ValueError, match="cpu_paged_attention: q must have dtype"):
        attn(q.double(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        attn(q, k_cache, v_cache, tables, lens[:2], 1.0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        attn(q, k_cache, v_cache, tables, lens, 1.0, window=-1)
    with pytest.raises(ValueError, match="out must have shape"):
        attn(q, k_cache, v_cache, tables, lens, 1.0, out=q[:1])
    k = torch.randn((2, 2, 64))
    with pytest.raises(ValueError, match="a slot is beyond the cache at token 1"):
        cpu_ops.cpu_kv_cache_write(k, k, k_cache, v_cache, torch.tensor([0, 16 * 16]))
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        cpu_ops.cpu_kv_cache_write(k, k, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))
    cache = compute_cos_sin_cache(64, 10000.0, 8, None)
    with pytest.raises(ValueError, match="outside the cos/sin table at token 1"):
        cpu_ops.cpu_rotary_embedding(torch.tensor([0, 8]), k.clone(), k.clone(), cache)
    with pytest.raises(ValueError, match="stride 1"):
        cpu_ops.cpu_silu_and_mul(torch.randn((4, 8)).t())
    with pytest.raises(ValueError, match="weight must have shape"):
        cpu_ops.cpu_rms_norm(torch.randn((2, 8)), torch.randn(4), 1e-6)
    assert torch.equal(k_cache, before)


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (the library is loaded once per process) asking for the kernels."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from tandem.kernels import cpu_ops; print('available', cpu_ops.available())\n"
        "from tandem import LLM, SamplingParams\n"
        "llm = LLM('demo', num_blocks=16)\n"
        "print('backend', llm.engine.runner.backend.cpu_kernels)\n"
        "out = llm.generate(['reverse: ab'], SamplingParams(temperature=0, max_tokens=4))\n"
        "print('tokens', out[0].token_ids)\n"
    )
    return subprocess.run(
        [sys.executable, "-P", "-c", code], env={**os.environ, **env}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def test_forced_fallback_and_a_failed_build_keep_the_torch_path(tmp_path: Path) -> None:
    """TANDEM_CPU_KERNELS=0 and a compiler that does not exist both fall back with exactly one
    log line and the same greedy tokens as the kernel path."""
    native = _probe({})
    assert "available True" in native.stdout, native.stderr
    tokens = next(ln for ln in native.stdout.splitlines() if ln.startswith("tokens"))
    for env, why in (
        ({cpu_build.DISABLE_ENV: "0"}, "disabled by TANDEM_CPU_KERNELS=0"),
        (
            {"CXX": str(tmp_path / "no-such-c++"), "TANDEM_KERNEL_CACHE": str(tmp_path / "c")},
            "no C++ compiler",
        ),
    ):
        probe = _probe(env)
        assert probe.returncode == 0, probe.stderr
        assert "available False" in probe.stdout and "backend False" in probe.stdout
        assert tokens in probe.stdout.splitlines()
        lines = [ln for ln in probe.stderr.splitlines() if "CPU kernels" in ln]
        assert len(lines) == 1 and why in lines[0], probe.stderr


def test_the_build_is_cached_by_source_compiler_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    compiler = cpu_build._compiler()
    path = cpu_build.library_path(compiler)
    assert path.parent == tmp_path and not path.exists()
    cpu_build.build(compiler, path)
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert cpu_build.library_path(compiler) == path  # same inputs, same file: no rebuild
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-DTANDEM_OTHER"))
    assert cpu_build.library_path(compiler) != path
    monkeypatch.setattr(cpu_build, "SOURCES", (tmp_path / "broken.cpp",))
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    with pytest.raises(cpu_build.BuildError, match="exited"):
        cpu_build.build(compiler, tmp_path / "broken.so")
    assert not (tmp_path / "broken.so").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "broken.cpp"])
