"""The fused CPU decoder forward (``cpu_forward.cpp``): a whole Llama-family step in one call.

Built once per engine by :class:`tandem.engine.cpu_forward.CpuForward` (which hands it the model's
weights) and run by it for every step that fits. It chains the kernels of ``cpu_kernels.cpp``
(the ones :mod:`tandem.kernels.cpu_ops` wraps and tests/kernels holds to the references) with the
few-row linear kernel (steps of at most ``cpu_ops.LINEAR_MAX_ROWS`` rows) or the sgemm of the BLAS
torch itself links (MKL), so an eager step's hundreds of small Python-dispatched
ops become one C call: the CPU counterpart of the CUDA graphs of the GPU path, without their
padding (the C code takes any number of tokens).

Everything is float32 on CPU. Weights must be contiguous; the KV cache is the block-major layout
``[blocks, layers, 2, block_size, kv_heads, head_dim]``, contiguous. Step inputs are checked here
(dtypes, shapes, contiguity) and in C (token ids, positions, slots and block tables in range)
before anything is written; a bad one raises ValueError and leaves the cache unchanged.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels import cpu_ops

__all__ = ["FusedLlamaForward", "LayerWeights", "sgemm_address"]

# The order of the C LayerField enum.
LAYER_FIELDS = (
    "input_norm", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "post_norm", "gate_up_w", "down_w",
)  # fmt: skip

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_F = ctypes.c_float


class _Plan(ctypes.Structure):
    _fields_ = [
        *[(n, _I) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                            "inter", "rot_dim", "vocab", "block_size", "num_blocks")],
        ("eps", _F), ("scale", _F), ("embed", _P), ("final_norm", _P), ("cos_sin", _P),
        ("max_pos", _I64), ("kv_cache", _P), ("layers", _P), ("sgemm", _P), ("linear_rows", _I),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("ids", _P), ("positions", _P), ("slots", _P), ("block_tables", _P),
        ("bt_stride", _I64), ("max_blocks", _I), ("qsl", _P), ("seq_lens", _P),
        ("num_seqs", _I), ("num_tokens", _I), ("num_threads", _I),
        *[(n, _P) for n in ("h", "residual", "normed", "qkv", "attn", "gate_up", "act", "out")],
    ]  # fmt: skip


@functools.cache
def sgemm_address() -> int | None:
    """The address of torch's BLAS sgemm_ (MKL on x86-64 builds), or None where torch's CPU
    library exports none (the fused forward is then unavailable and the eager path runs)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if path.is_file():
            try:
                fn = ctypes.CDLL(str(path)).sgemm_
            except (OSError, AttributeError):
                return None
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's float32 weights, Hugging Face shapes ([out, in] for projections)."""

    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    window: int


def _need(what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"fused forward: {what} must be a contiguous float32 CPU tensor")
    if tuple(t.shape) != shape:
        raise ValueError(f"fused forward: {what} must have shape {shape}, got {tuple(t.shape)}")


class FusedLlamaForward:
    """Owns the Plan (weight addresses; the tensors are kept referenced so they stay valid) and
    scratch buffers that grow to the largest step seen, up to ``max_tokens`` rows."""

    def __init__(
        self,
        *,
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layers: list[LayerWeights],
        num_heads: int,
        eps: float,
        scale: float,
        max_tokens: int,
    ) -> None:
        if not cpu_ops.available() or (sgemm := sgemm_address()) is None:
            raise RuntimeError("the fused CPU forward needs the CPU kernels and torch's sgemm_")
        vocab, hidden = embed.shape
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        inter = layers[0].down_w.shape[1]
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        _need("embed", embed, (vocab, hidden))
        _need("final_norm", final_norm, (hidden,))
        _need("kv_cache", kv_cache, tuple(kv_cache.shape))
        if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or cos_sin.shape[1] > head_dim:
            raise ValueError("fused forward: cos_sin must be [max_pos, rot_dim], rot_dim even")
        _need("cos_sin", cos_sin, tuple(cos_sin.shape))
        if len(layers) != num_layers:
            raise ValueError(f"fused forward: {len(layers)} layers for a {num_layers}-layer cache")
        shapes = {
            "input_norm": (hidden,), "qkv_w": (q + 2 * kv, hidden), "qkv_b": (q + 2 * kv,),
            "q_norm": (head_dim,), "k_norm": (head_dim,), "o_w": (hidden, q),
            "post_norm": (hidden,), "gate_up_w": (2 * inter, hidden), "down_w": (hidden, inter),
        }  # fmt: skip
        table = torch.zeros((num_layers, len(LAYER_FIELDS) + 1), dtype=torch.int64)
        for i, lw in enumerate(layers):
            if (lw.q_norm is None) != (lw.k_norm is None) or lw.window < 0:
                raise ValueError("fused forward: q_norm and k_norm come together; window >= 0")
            for j, name in enumerate(LAYER_FIELDS):
                t = getattr(lw, name)
                if t is not None:
                    _need(f"layers[{i}].{name}", t, shapes[name])
                    table[i, j] = t.data_ptr()
            table[i, len(LAYER_FIELDS)] = lw.window
        self._keep = (embed, final_norm, cos_sin, kv_cache, layers, table)
        self._fn = cpu_ops.raw_function("tandem_llama_forward_f32", [_P, _P], _I)
        self.plan = _Plan(
            num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, cos_sin.shape[1], vocab,
            block_size, num_blocks, eps, scale, embed.data_ptr(), final_norm.data_ptr(),
            cos_sin.data_ptr(), cos_sin.shape[0], kv_cache.data_ptr(), table.data_ptr(), sgemm,
            cpu_ops.LINEAR_MAX_ROWS,
        )  # fmt: skip
        self.hidden, self.max_tokens = hidden, max_tokens
        self._widths = {"h": hidden, "residual": hidden, "normed": hidden, "qkv": q + 2 * kv,
                        "attn": q, "gate_up": 2 * inter, "act": inter, "out": hidden}  # fmt: skip
        self._scratch: dict[str, torch.Tensor] = {}
        self._rows = 0
        self._step = _Step()

    def _grow(self, rows: int) -> None:
        rows = min(self.max_tokens, max(rows, 2 * self._rows, 16))
        self._scratch = {n: torch.empty((rows, w)) for n, w in self._widths.items()}
        for n, t in self._scratch.items():
            setattr(self._step, n, t.data_ptr())
        self._rows = rows

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for T = len(input_ids) <= max_tokens;
        query_start_loc None means decode (one token per sequence). The result is a view of a
        scratch buffer, valid until the next call."""
        t, s = input_ids.shape[0], seq_lens.shape[0]
        ok = (
            0 < t <= self.max_tokens
            and all(x.dtype is torch.int64 and x.shape == (t,) and x.is_contiguous() and x.is_cpu
                    for x in (input_ids, positions, slot_mapping))
            and block_tables.dtype is torch.int32 and block_tables.dim() == 2
            and block_tables.shape[0] == s and block_tables.stride(1) == 1 and block_tables.is_cpu
            and seq_lens.dtype is torch.int32 and seq_lens.is_contiguous() and seq_lens.is_cpu
            and (t == s if query_start_loc is None else (
                query_start_loc.dtype is torch.int32 and query_start_loc.shape == (s + 1,)
                and query_start_loc.is_contiguous() and query_start_loc.is_cpu))
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"fused forward: expected {t} <= {self.max_tokens} tokens with int64 contiguous "
                "ids/positions/slots, int32 block_tables rows and seq_lens, and int32 "
                "query_start_loc [S + 1] (or None with one token per sequence)"
            )
        if t > self._rows:
            self._grow(t)
        st = self._step
        st.ids, st.positions, st.slots = (
            input_ids.data_ptr(),
            positions.data_ptr(),
            slot_mapping.data_ptr(),
        )
        st.block_tables, st.bt_stride = block_tables.data_ptr(), block_tables.stride(0)
        st.max_blocks = block_tables.shape[1]
        st.qsl = None if query_start_loc is None else query_start_loc.data_ptr()
        st.seq_lens, st.num_seqs, st.num_tokens = seq_lens.data_ptr(), s, t
        st.num_threads = torch.get_num_threads()
        code = self._fn(ctypes.byref(self.plan), ctypes.byref(st))
        if code:
            what = {-1: "a token id", -2: "a position", -3: "a slot"}.get(code)
            raise ValueError(
                f"fused forward: {what or f'the attention metadata of sequence {-code - 4}'} "
                "is out of range; nothing was written"
            )
        return self._scratch["out"][:t]
