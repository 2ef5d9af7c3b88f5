"""The argument checks of the paged attention wrappers, in one place.

:func:`check_paged_attention_args` is called first thing by ``paged_decode_attention`` (one query
row per sequence) and ``paged_extend_attention`` (packed query rows delimited by
``query_start_loc``), so neither launches on arguments that the kernel would read out of bounds or
misinterpret. Nothing here needs triton.
"""

from __future__ import annotations

import torch

from tandem.kernels.launch import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    check_on_cpu,
    check_shape,
)

INDEX_DTYPES = (torch.int32, torch.int64)


def check_paged_attention_args(
    name: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    *,
    cpu: bool = False,
) -> None:
    """Raise ValueError, naming the wrapper and the argument, unless the arguments fit the kernels.

    Decode passes no query_start_loc: q is [B, Hq, D], one row per sequence. Extend passes it: q is
    [T, Hq, D] packed, and the number of sequences is seq_lens' length. ``cpu``: the CPU kernels
    of :mod:`tandem.kernels.cpu_ops` (float32 CPU tensors) instead of Triton's devices and dtypes.
    """
    decode = query_start_loc is None
    if q.dim() != 3 or k_cache.dim() != 4:
        rows = "B" if decode else "T"
        raise ValueError(
            f"{name}: q must be [{rows}, Hq, D] and k_cache [blocks, block_size, Hkv, D]"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{name}: {num_heads} query heads not a multiple of {num_kv_heads}")
    num_seqs = q.shape[0] if decode else seq_lens.shape[0]
    check_shape(name, "k_cache", k_cache, (*k_cache.shape[:3], head_dim))
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    check_shape(name, "seq_lens", seq_lens, (num_seqs,))
    index = [("block_tables", block_tables), ("seq_lens", seq_lens)]
    if query_start_loc is not None:
        check_shape(name, "query_start_loc", query_start_loc, (num_seqs + 1,))
        index.insert(1, ("query_start_loc", query_start_loc))
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{name}: block_tables must be [{num_seqs}, max_blocks]")
    check_dtype(name, "q", q, (torch.float32,) if cpu else FLOAT_DTYPES)
    check_dtype(name, "k_cache", k_cache, (q.dtype,))
    check_dtype(name, "v_cache", v_cache, (q.dtype,))
    for what, t in index:
        check_dtype(name, what, t, INDEX_DTYPES)
    for what, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, what, t)
    # Kernels read block_tables row by row and the per-sequence vectors by plain offsets.
    if block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables rows must be contiguous")
    for what, t in index[1:]:
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
    tensors = (q, k_cache, v_cache, *(t for _, t in index))
    if cpu:
        check_on_cpu(name, *tensors)
    else:
        check_launchable(name, *tensors)


def check_out(name: str, out: torch.Tensor, q: torch.Tensor) -> None:
    """A caller-provided output must match q's shape and dtype, with stride 1 in head_dim."""
    check_shape(name, "out", out, tuple(q.shape))
    check_dtype(name, "out", out, (q.dtype,))
    check_last_dim_contiguous(name, "out", out)


def check_tile(name: str, what: str, size: int) -> None:
    """Tile sizes feed tl.arange and tl.dot, which need powers of two of at least 16."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name}: {what} must be a power of two >= 16")
