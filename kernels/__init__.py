"""Tandem's Triton kernels and their PyTorch references (``*_ref``), and the CPU kernels
(:mod:`tandem.kernels.cpu_ops`, :mod:`tandem.kernels.cpu_forward`, built at first use).

There is no sampling kernel: the engine's :class:`~tandem.engine.sampler.Sampler` samples with
PyTorch on every device. A Triton greedy argmax computed exactly ``torch.argmax`` (one reduction
kernel on CUDA already), and a Triton draw cannot consume a request's ``torch.Generator``, which
seeded requests need to give the same tokens on every backend and in every batch; the former
``kernels/sampling.py`` was therefore never wired in and was removed.

The references live in :mod:`tandem.kernels.refs` (pure PyTorch; the CPU path runs on them) and
are re-exported by each kernel's module. Names resolve lazily so that ``import tandem.kernels``
does not import triton (an optional dependency on CPU-only installs) until a kernel is first used;
the references and the rotary table never import it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "kv_cache_write": "kv_cache_write",
    "kv_cache_write_ref": "refs",
    "gather_seq_kv_ref": "refs",
    "attention_ref": "refs",
    "paged_decode_attention": "decode_attention",
    "paged_decode_attention_ref": "refs",
    "paged_extend_attention": "extend_attention",
    "paged_extend_attention_ref": "refs",
    "rms_norm": "rms_norm",
    "rms_norm_ref": "refs",
    "rotary_embedding": "rotary",
    "rotary_embedding_ref": "refs",
    "compute_cos_sin_cache": "rope_cache",
    "compute_inv_freq": "rope_cache",
    "silu_and_mul": "activation",
    "silu_and_mul_ref": "refs",
    "DecodeGraphRunner": "cuda_graph",
    "GraphInput": "cuda_graph",
    "capture_batch_sizes": "cuda_graph",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tandem.kernels.{module}"), name)
