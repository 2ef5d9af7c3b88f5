"""Shared fixtures: tiny random-weight HF checkpoints written to disk, loaded by both our engine
and transformers, so parity tests compare the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from checkpoints import write_random_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton decides compiled-or-interpreted when a kernel module is imported, so this must be set
# before any test imports tandem.kernels: without a GPU, kernels run in the CPU interpreter.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def llama_gqa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llama_gqa"), "llama")


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=1, tie_word_embeddings=True
    )
