"""The single PyTorch references: importable without triton, and re-exported (not redefined) by
the kernel modules."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import torch

import tandem.kernels as kernels
from tandem.kernels import refs

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
        "import tandem.kernels.refs, tandem.kernels.rope_cache\n"
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
