"""Transparent huge pages for the KV cache on a CPU host (Linux).

Called by ``ModelRunner`` once, when it allocates the KV cache on the CPU. A decode step reads
every running sequence's K/V blocks, which lie scattered over a cache of hundreds of MiB; in the
benchmarks' hidden-256 model one layer's K (or V) of a block is 4 KiB, one page, so with 4 KiB
pages nearly every block read also misses the TLB. Advising the range ``MADV_HUGEPAGE`` before
its pages are first touched lets the kernel back it with 2 MiB pages. Measured on this
project's 2-core machine (``benchmarks/cpu_attention.py``, decode attention over 90 MB of
scattered K/V): 8.3-11.0 ms on 4 KiB pages, 7.1-8.2 ms on 2 MiB pages (docs/benchmarks.md,
fifth round).

Where the advice cannot apply (not Linux, THP set to ``never``, a tensor under 4 MiB) nothing
changes: the tensor is the same zeroed tensor either way, and the result says which it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from functools import cache

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE_BYTES = 2 << 20


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned part of ``t``'s memory ``MADV_HUGEPAGE``; True if the kernel
    accepted it. Only pages touched after the call are backed huge at once, so call it on a
    fresh ``torch.empty`` before writing."""
    nbytes = t.numel() * t.element_size()
    if sys.platform != "linux" or t.device.type != "cpu" or nbytes < 2 * HUGE_PAGE_BYTES:
        return False
    libc = _libc()
    if libc is None:
        return False
    start = t.data_ptr()
    lo = (start + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    hi = (start + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor whose pages were advised huge before first touch, and whether the
    advice was taken."""
    t = torch.empty(shape, dtype=dtype)
    advised = advise_huge_pages(t)
    if advised:
        log.info("%d MiB advised onto transparent huge pages", t.numel() * t.element_size() >> 20)
    return t.zero_(), advised
