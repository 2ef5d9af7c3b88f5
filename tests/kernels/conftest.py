"""Kernel tests run on CPU under Triton's interpreter unless CUDA exists.

Triton decides at decoration time whether a @triton.jit function is interpreted, so the variable
must be set before any tandem.kernels module is imported; this conftest is imported before the
test modules of this folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INT_SENTINEL = -7


@pytest.fixture
def poisoned_alloc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make torch.empty / torch.empty_like return NaN (floats) or -7 (integers) during a test, so
    any output element a kernel forgets to write is caught."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else INT_SENTINEL)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in item.path.parents:
            item.add_marker(skip)
