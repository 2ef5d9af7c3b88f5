"""Value types and the engine-facing interface of the KV connector.

The engine owns the KV cache tensor; the connector only reads (prefill) or writes (decode) the
blocks named in calls. See ``KVConnector`` for the call order and thread-safety contract.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch

# Block ids and counts are bounded so a hostile dict cannot make us allocate without limit.
MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_ID_LEN = 256
_SIDE_CHANNEL_RE = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")

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


class FailureReason(StrEnum):
    """Why a load failed or a lease ended early; also the `reason` label of the failure metric."""

    HANDSHAKE = "handshake_failed"
    LAYOUT_MISMATCH = "layout_mismatch"
    STALE_ENGINE = "stale_engine"
    UNKNOWN_REQUEST = "unknown_request"
    INVALID_REQUEST = "invalid_request"
    PEER_ABORTED = "aborted_by_peer"
    ABORTED = "aborted"
    TIMEOUT = "timeout"
    TRANSFER_ERROR = "transfer_error"
    PEER_DISCONNECTED = "peer_disconnected"
    BAD_MESSAGE = "bad_message"
    LEASE_EXPIRED = "lease_expired"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one engine's KV cache: ``[num_blocks, num_layers, 2, block_size, heads, dim]``."""

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
    def element_size(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def block_bytes(self) -> int:
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * (self.element_size)
        )

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
        if tuple(kv_cache.shape) != self.shape or kv_cache.dtype != DTYPES[self.dtype]:
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


def _check_id(name: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LEN:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_ID_LEN} chars")
    return value


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """What prefill hands back (via the router) so a decode engine can pull the blocks."""

    engine_id: str
    side_channel: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    lease_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "side_channel": self.side_channel,
            "remote_request_id": self.remote_request_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "first_token_id": self.first_token_id,
            "lease_seconds": self.lease_seconds,
        }

    @classmethod
    def from_dict(cls, data: Any) -> KVTransferParams:
        """Strictly validated; ValueError naming the first bad field. Extra keys are refused."""
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_params must be an object")
        expected = {
            "engine_id",
            "side_channel",
            "remote_request_id",
            "block_ids",
            "num_tokens",
            "first_token_id",
            "lease_seconds",
        }
        if set(data) != expected:
            missing, extra = expected - set(data), set(data) - expected
            raise ValueError(
                f"kv_transfer_params keys: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        side = data["side_channel"]
        if not isinstance(side, str) or not _SIDE_CHANNEL_RE.match(side):
            raise ValueError(f"side_channel must look like tcp://host:port, got {side!r}")
        blocks = data["block_ids"]
        if not isinstance(blocks, list | tuple) or len(blocks) > MAX_BLOCKS_PER_REQUEST:
            raise ValueError("block_ids must be a list of at most 2**20 ints")
        for b in blocks:
            _check_int("block_ids[]", b, 0, 2**31 - 1)
        if len(set(blocks)) != len(blocks):
            raise ValueError("block_ids must not repeat")
        lease = data["lease_seconds"]
        if type(lease) not in (int, float) or not math.isfinite(lease) or not 0 < lease <= 3600:
            raise ValueError(f"lease_seconds must be in (0, 3600], got {lease!r}")
        return cls(
            engine_id=_check_id("engine_id", data["engine_id"]),
            side_channel=side,
            remote_request_id=_check_id("remote_request_id", data["remote_request_id"]),
            block_ids=tuple(blocks),
            num_tokens=_check_int("num_tokens", data["num_tokens"], 0, 2**31 - 1),
            first_token_id=_check_int("first_token_id", data["first_token_id"], 0, 2**31 - 1),
            lease_seconds=float(lease),
        )


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one ``start_load``; ``ok`` False means the blocks must not be decoded from."""

    request_id: str
    ok: bool
    reason: FailureReason | None = None
    detail: str | None = None


class KVConnector(Protocol):
    """The engine's view of the connector.

    Thread-safety: every method may be called from the engine thread (one thread, between steps)
    while the transports run on the connector's own threads. Methods never block on the network.
    """

    engine_id: str
    side_channel_address: str

    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        """Prefill: after a request's prefill finished. The engine keeps ``block_ids`` pinned
        until ``take_released`` returns ``request_id``."""
        ...

    def take_released(self) -> list[str]:
        """Prefill, every step: request ids whose pinned blocks the engine must now free
        (decode confirmed or failed, lease expired, aborted by either side)."""
        ...

    def hold(self, request_id: str, params: KVTransferParams) -> None:
        """Decode, optional: the request is admitted but waits for blocks; renew prefill's
        lease until ``start_load`` or ``abort`` (abort also releases prefill's blocks)."""
        ...

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        """Decode: pull ``remote_block_ids[i]`` into ``local_block_ids[i]`` asynchronously.
        The engine owns the local blocks and must not free them before the LoadResult arrives.
        ValueError for inconsistent arguments (nothing started)."""
        ...

    def take_finished_loads(self) -> list[LoadResult]:
        """Decode, every step: loads that ended; each started load ends exactly once."""
        ...

    def abort(self, request_id: str) -> None:
        """Prefill: release now and tell decode. Decode: cancel the pull and tell prefill; the
        LoadResult (reason ABORTED) still arrives, once nothing writes the local blocks."""
        ...

    def close(self) -> None:
        """Stop threads and sockets; pending loads end as CLOSED. Idempotent."""
        ...
