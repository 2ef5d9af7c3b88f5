"""Checked wrappers of the CPU kernels (``cpu_kernels.cpp``), float32 on CPU tensors.

Called by the torch attention backend (paged attention and the KV write) and by the model's
``FusedOps`` (RMSNorm + residual, SiLU-and-mul, rotary, and the linear layers of steps with at
most :data:`LINEAR_MAX_ROWS` rows) when :func:`available` is true; each wrapper
computes exactly what its reference in :mod:`tandem.kernels.refs` computes (tests/kernels holds
them to it, edge shapes included). The library is built at first use by
:mod:`tandem.kernels.cpu_build`; where it cannot be, :func:`available` is false and callers keep
the references. Arguments are checked before any pointer is handed to C; a wrong shape, dtype,
device or stride raises ValueError naming the wrapper and the argument.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from tandem.kernels import cpu_build
from tandem.kernels.launch import check_dtype, check_on_cpu, check_shape
from tandem.kernels.paged_args import check_out, check_paged_attention_args

__all__ = [
    "LINEAR_MAX_ROWS",
    "available",
    "cpu_argmax",
    "cpu_kv_cache_write",
    "cpu_linear",
    "cpu_paged_attention",
    "cpu_rms_norm",
    "cpu_rotary_embedding",
    "cpu_silu_and_mul",
]

# Up to this many rows, cpu_linear beats torch's BLAS on the decode step's shapes (measured on this
# project's 2-core VMs through F.linear, weights warm: 1.07-1.16x at one row, 1.4-2.8x at 2-3,
# level at 4, and 0.56-0.87x at 8, where MKL's register blocking wins); the fused forward and
# FusedOps use it up to here and the BLAS above.
LINEAR_MAX_ROWS = 4

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_F = ctypes.c_float
_SIGNATURES: dict[str, list[Any]] = {
    "tandem_kv_cache_write_f32": [_P, _P, *[_I64] * 4, _P, _P, *[_I64] * 6, _P, _I64, *[_I] * 5],
    "tandem_paged_attention_f32": [
        _P,
        _I64,
        _I64,
        _P,
        _P,
        *[_I64] * 6,
        _P,
        _I64,
        _I,
        _I,
        _P,
        _P,
        *[_I] * 6,
        _F,
        _I,
        _P,
        _I64,
        _I64,
        _I,
    ],  # fmt: skip
    "tandem_rms_norm_f32": [_P, _I64, _P, _I64, _P, _F, _P, _I64, _P, _I64, _I, _I, _I],
    "tandem_silu_and_mul_f32": [_P, _I64, _P, _I64, _I, _I, _I],
    "tandem_rotary_f32": [_P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, *[_I] * 5],
    "tandem_linear_f32": [_P, _I64, _P, _P, _P, _I64, *[_I] * 4],
    "tandem_argmax_f32": [_P, _I64, _I, _I, _P, _I],
}
# Functions that return a status: 0, or 1 + the index of the first bad token or sequence.
_CHECKED = ("tandem_kv_cache_write_f32", "tandem_paged_attention_f32", "tandem_rotary_f32")


class _Lib:
    """The loaded library with its functions' argument types declared (ctypes then converts and
    checks every argument, and a wrong count raises instead of corrupting the stack)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name in _CHECKED else None
            setattr(self, name.removeprefix("tandem_").removesuffix("_f32"), fn)


_lib: _Lib | None = None
_raw: ctypes.CDLL | None = None
_loaded = False


def available() -> bool:
    """True when the library is built and loaded (the first call builds it, or logs why not)."""
    global _lib, _raw, _loaded
    if not _loaded:
        _raw = cpu_build.load()
        _lib = _Lib(_raw) if _raw is not None else None
        _loaded = True
    return _lib is not None


def raw_function(name: str, argtypes: list[Any], restype: Any) -> Any:
    """Another entry point of the same library (the fused forward's), with its types declared;
    its caller (:mod:`tandem.kernels.cpu_forward`) checks its arguments."""
    if not available():
        raise RuntimeError("the CPU kernels are not available (see the log for why)")
    fn = getattr(_raw, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _get() -> Any:
    if not available():
        raise RuntimeError("the CPU kernels are not available (see the log for why)")
    return _lib


def _unfit(t: torch.Tensor) -> bool:
    """The cheap test every float tensor passes before its pointer goes to C."""
    return t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1


def _check_f32(name: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor that is not float32 on CPU with stride 1 last."""
    for what, t in tensors.items():
        check_dtype(name, what, t, (torch.float32,))
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} must have stride 1 in its last dimension")
    check_on_cpu(name, *tensors.values())


def _status(name: str, what: str, code: int) -> None:
    if code:
        raise ValueError(f"{name}: {what} {code - 1}")


def _threads() -> int:
    return torch.get_num_threads()


def cpu_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    *,
    window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention straight from the block table (no gather), one call per layer.

    Without query_start_loc it is decode (q [B, Hq, D], row i at position seq_lens[i] - 1;
    reference :func:`~tandem.kernels.refs.paged_decode_attention_ref`); with it, packed extend
    rows over the cached prefix plus the new tokens (reference
    :func:`~tandem.kernels.refs.paged_extend_attention_ref`), which also serves decode rows of a
    mixed batch. window > 0 is sliding-window attention: a query at position p sees keys
    p - window < j <= p. Rows of no sequence and sequences of length 0 come back zero.
    Metadata that would read outside the cache (a block id, a length beyond its table row,
    query rows out of order) raises ValueError naming the sequence, before anything is read.
    """
    name = "cpu_paged_attention"
    check_paged_attention_args(
        name, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, cpu=True
    )
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0, got {window}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(name, out, q)
    tables = block_tables if block_tables.dtype is torch.int32 else block_tables.int()
    lens = seq_lens if seq_lens.dtype is torch.int32 else seq_lens.int()
    qsl = query_start_loc
    if qsl is not None and qsl.dtype is not torch.int32:
        qsl = qsl.int()
    ks, vs = k_cache.stride(), v_cache.stride()
    code = _get().paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], tables.data_ptr(), tables.stride(0),
        tables.shape[1], k_cache.shape[0], None if qsl is None else qsl.data_ptr(),
        lens.data_ptr(), lens.shape[0], q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
        k_cache.shape[1], scale, window, out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(),
    )  # fmt: skip
    _status(name, "inconsistent metadata (lengths, query rows or block ids) for sequence", code)
    return out


def cpu_kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] ([T, H, D]) to slot slot_mapping[t]; slots < 0 are skipped. Reference:
    :func:`~tandem.kernels.refs.kv_cache_write_ref`. A slot beyond the cache raises ValueError
    and nothing is written."""
    name = "cpu_kv_cache_write"
    if (
        _unfit(k) or _unfit(v) or _unfit(k_cache) or _unfit(v_cache) or k.dim() != 3
        or k_cache.dim() != 4 or v.shape != k.shape or v_cache.shape != k_cache.shape
        or k_cache.shape[2:] != k.shape[1:] or slot_mapping.dtype is not torch.int64
        or not slot_mapping.is_cpu or slot_mapping.shape != (k.shape[0],)
        or not slot_mapping.is_contiguous()
    ):  # fmt: skip
        _explain_kv_write(name, k, v, k_cache, v_cache, slot_mapping)
    ks, vs = k_cache.stride(), v_cache.stride()
    code = _get().kv_cache_write(
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        slot_mapping.data_ptr(), k_cache.shape[0] * k_cache.shape[1], k.shape[0], k.shape[1],
        k.shape[2], k_cache.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    _status(name, "a slot is beyond the cache at token", code)


def _explain_kv_write(
    name: str,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The slow path of the check: raise the ValueError that names what is wrong."""
    _check_f32(name, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"{name}: k must be [T, H, D] and k_cache [blocks, block_size, H, D]")
    check_shape(name, "v", v, tuple(k.shape))
    check_shape(name, "k_cache", k_cache, (*k_cache.shape[:2], *k.shape[1:]))
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    check_shape(name, "slot_mapping", slot_mapping, (k.shape[0],))
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int64,))
    check_on_cpu(name, slot_mapping)
    raise ValueError(f"{name}: slot_mapping must be contiguous")


def cpu_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, H] (or of x + residual) times weight; returns (out, x + residual or None).
    Reference: :func:`~tandem.kernels.refs.rms_norm_ref` (float32, so its roundings are no-ops)."""
    name = "cpu_rms_norm"
    if (
        _unfit(x) or _unfit(weight) or x.dim() != 2 or weight.shape != (x.shape[1],)
        or (residual is not None and (_unfit(residual) or residual.shape != x.shape))
    ):  # fmt: skip
        tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
        _check_f32(name, **tensors)
        if x.dim() != 2:
            raise ValueError(f"{name}: x must be [T, H], got {tuple(x.shape)}")
        check_shape(name, "weight", weight, (x.shape[1],))
        check_shape(name, "residual", residual, tuple(x.shape))  # type: ignore[arg-type]
    out = torch.empty_like(x)
    new_res = res_ptr = new_ptr = None
    res_stride = new_stride = 0
    if residual is not None:
        new_res = torch.empty_like(x)
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        new_ptr, new_stride = new_res.data_ptr(), new_res.stride(0)
    _get().rms_norm(
        x.data_ptr(), x.stride(0), res_ptr, res_stride, weight.data_ptr(), eps, out.data_ptr(),
        out.stride(0), new_ptr, new_stride, x.shape[0], x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out, new_res


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N], any row stride of x; weight and bias
    contiguous. Exact for any T, fast for T <= LINEAR_MAX_ROWS (callers pick). Reference:
    :func:`~tandem.kernels.refs.linear_ref`."""
    name = "cpu_linear"
    if (
        _unfit(x) or _unfit(weight) or x.dim() != 2 or weight.dim() != 2
        or weight.shape[1] != x.shape[1] or not weight.is_contiguous()
        or (bias is not None and (_unfit(bias) or bias.shape != (weight.shape[0],)))
    ):  # fmt: skip
        tensors = {"x": x, "weight": weight} | ({} if bias is None else {"bias": bias})
        _check_f32(name, **tensors)
        if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
            raise ValueError(
                f"{name}: x must be [T, K] and weight [N, K], got {tuple(x.shape)} and "
                f"{tuple(weight.shape)}"
            )
        if not weight.is_contiguous():
            raise ValueError(f"{name}: weight must be contiguous")
        check_shape(name, "bias", bias, (weight.shape[0],))  # type: ignore[arg-type]
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    if x.shape[0] and weight.shape[0]:
        _get().linear(
            x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), x.shape[0], weight.shape[0], weight.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I] = silu(x[:, :I]) * x[:, I:]. Reference:
    :func:`~tandem.kernels.refs.silu_and_mul_ref`."""
    name = "cpu_silu_and_mul"
    if _unfit(x) or x.dim() != 2 or x.shape[1] % 2:
        _check_f32(name, x=x)
        raise ValueError(f"{name}: x must be [T, 2I], got {tuple(x.shape)}")
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    _get().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), inter, x.shape[0], inter,
                        torch.get_num_threads())  # fmt: skip
    return out


def cpu_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> int64 [B]: each row's largest entry's index, the first of equal ones, the first
    NaN where there is one. Reference: :func:`~tandem.kernels.refs.argmax_ref` (torch.argmax).
    The sampler's greedy rows take it (engine/sampler.py)."""
    name = "cpu_argmax"
    if _unfit(x) or x.dim() != 2 or x.shape[1] == 0:
        _check_f32(name, x=x)
        raise ValueError(f"{name}: x must be [B, V] with V > 0, got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _get().argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(),
                  torch.get_num_threads())  # fmt: skip
    return out


def cpu_rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (neox style, first rot_dim dims), any row
    and head strides. Reference: :func:`~tandem.kernels.refs.rotary_embedding_ref`. A position
    outside the table raises ValueError and nothing is rotated."""
    name = "cpu_rotary_embedding"
    if (
        _unfit(q) or _unfit(k) or _unfit(cos_sin_cache) or q.dim() != 3 or k.dim() != 3
        or cos_sin_cache.dim() != 2 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]
        or positions.shape != (q.shape[0],) or positions.dtype is not torch.int64
        or not positions.is_cpu or not positions.is_contiguous()
        or not cos_sin_cache.is_contiguous() or cos_sin_cache.shape[1] % 2
        or cos_sin_cache.shape[1] > q.shape[2]
    ):  # fmt: skip
        _explain_rotary(name, positions, q, k, cos_sin_cache)
    code = _get().rotary(
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
        k.stride(1), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], cos_sin_cache.shape[1],
        q.shape[0], q.shape[1], k.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    _status(name, "a position is outside the cos/sin table at token", code)


def _explain_rotary(
    name: str, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> None:
    _check_f32(name, q=q, k=k, cos_sin_cache=cache)
    check_on_cpu(name, positions)
    if q.dim() != 3 or k.dim() != 3 or cache.dim() != 2:
        raise ValueError(f"{name}: q, k must be [T, H, D] and cos_sin_cache [max_pos, rot_dim]")
    check_shape(name, "k", k, (q.shape[0], k.shape[1], q.shape[2]))
    check_shape(name, "positions", positions, (q.shape[0],))
    check_dtype(name, "positions", positions, (torch.int64,))
    if not positions.is_contiguous():
        raise ValueError(f"{name}: positions must be contiguous")
    raise ValueError(f"{name}: cos_sin_cache must be contiguous, rot_dim even and <= D")
