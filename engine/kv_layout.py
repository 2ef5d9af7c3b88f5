"""The one description of a worker's KV cache layout, used by the model runner and the connector.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block-major, so one block of one request is a single contiguous byte range across all layers:
the KV connector moves a run of consecutive blocks with one copy instead of 2 * num_layers.
The ModelRunner allocates the tensor from a ``KVLayout``; the connector checks the tensor it is
given against the layout and sends the layout in its handshake (``to_wire``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ValueError for dtypes a KV cache never uses."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV cache dtype {dtype}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one engine's KV cache (see the module docstring for the axes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V."""
        per_block = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return per_block * self.element_size

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def with_num_blocks(self, num_blocks: int) -> KVLayout:
        return replace(self, num_blocks=num_blocks)

    @classmethod
    def from_kv_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                f"kv_cache must be [blocks, layers, 2, block, heads, dim], got "
                f"{tuple(kv_cache.shape)}"
            )
        nb, nl, _, bs, nh, hd = kv_cache.shape
        return cls(nl, nh, hd, bs, dtype_name(kv_cache.dtype), nb)

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """ValueError unless ``kv_cache`` has exactly this layout and is contiguous."""
        if tuple(kv_cache.shape) != self.shape or kv_cache.dtype != self.torch_dtype:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match layout "
                f"{self.shape} {self.dtype}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (block-major)")

    def to_wire(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "num_blocks": self.num_blocks,
        }


# Fields that must agree between prefill and decode; num_blocks is each engine's own business.
COMPATIBLE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


def layout_mismatch(local: KVLayout, remote: KVLayout) -> str | None:
    """None when the two layouts can exchange blocks, else a message naming every difference."""
    diffs = [
        f"{f} (local {getattr(local, f)!r}, remote {getattr(remote, f)!r})"
        for f in COMPATIBLE_FIELDS
        if getattr(local, f) != getattr(remote, f)
    ]
    return "KV layout mismatch: " + ", ".join(diffs) if diffs else None
