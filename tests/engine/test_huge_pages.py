"""Huge pages for the CPU KV cache (engine/huge_pages.py): the advice lands on the tensor's own
memory, and the tensor is the same zeroed tensor whether or not it was taken."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tandem.engine import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_allows_madvise() -> bool:
    return sys.platform == "linux" and THP.exists() and "[never]" not in THP.read_text()


def advised_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s range in mappings the kernel marks ``hg`` (MADV_HUGEPAGE)."""
    a0, a1 = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, span = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            span = (max(lo, a0), min(hi, a1)) if lo < a1 and hi > a0 else None
        elif span is not None and line.startswith("VmFlags:") and " hg" in line:
            total += span[1] - span[0]
    return total


def test_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype() -> None:
    t, _ = huge_pages.zeros((5, 1 << 20), torch.float32)
    assert t.shape == (5, 1 << 20) and t.dtype is torch.float32
    assert int(torch.count_nonzero(t)) == 0


@pytest.mark.skipif(not thp_allows_madvise(), reason="transparent huge pages are off here")
def test_a_large_tensor_is_advised_huge_over_all_its_aligned_pages() -> None:
    t, advised = huge_pages.zeros((24, 1 << 20), torch.float32)  # 96 MiB
    assert advised
    nbytes = t.numel() * 4
    # Everything but the unaligned head and tail (each under one 2 MiB page).
    assert nbytes - 2 * huge_pages.HUGE_PAGE_BYTES <= advised_bytes(t) <= nbytes


def test_small_and_non_cpu_tensors_are_left_alone() -> None:
    small, advised = huge_pages.zeros((3 << 18,), torch.float32)  # 3 MiB: under two huge pages
    assert not advised
    assert not huge_pages.advise_huge_pages(torch.empty((8 << 20,), device="meta"))
    assert int(torch.count_nonzero(small)) == 0
