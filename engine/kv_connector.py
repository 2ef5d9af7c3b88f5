"""The seam between the engine and the KV connector: the types both sides speak, and the
``KVConnector`` protocol that the prefill and decode role hooks drive.

The engine core defines them and imports no transport; ``tandem.kvtransfer`` implements the
protocol. The engine owns the KV cache tensor; the connector only reads (prefill) or writes
(decode) the blocks named in calls. ``KVTransferParams`` travels from prefill to decode through
the router and is validated strictly on arrival.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

# Block ids and counts are bounded so a hostile dict cannot make us allocate without limit.
MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_ID_LEN = 256
_SIDE_CHANNEL_RE = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")
_SECRET_RE = re.compile(r"^[0-9a-f]{64}$")


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
    UNAUTHORIZED = "unauthorized"  # no cluster token, or no proof of the transfer's secret
    UNKNOWN_TRANSFER = "unknown_transfer"  # data for a transfer this connection did not open
    INCOMPATIBLE = "incompatible"  # the peer's fingerprint differs (another model or version)


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
    """What prefill hands back (via the router) so a decode engine can pull the blocks.

    ``transfer_secret`` is issued by the sender for this grant alone and travels only through
    the authenticated router: the puller proves it holds it (kvtransfer/auth.py) and the sender
    sends blocks to nobody else. It is never logged (``repr`` hides it).
    """

    engine_id: str
    side_channel: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    lease_seconds: float
    transfer_secret: str = field(repr=False)
    # A peer's prefix grant: the checksum (engine/kv_checksum.py) of each block's bytes, which
    # the puller checks before using them; empty (and absent on the wire) for a hand-off.
    block_checksums: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = self._base_dict()
        if self.block_checksums:
            out["block_checksums"] = list(self.block_checksums)
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "side_channel": self.side_channel,
            "remote_request_id": self.remote_request_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "first_token_id": self.first_token_id,
            "lease_seconds": self.lease_seconds,
            "transfer_secret": self.transfer_secret,
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
            "transfer_secret",
        }
        keys = set(data) - {"block_checksums"}
        if keys != expected:
            missing, extra = expected - keys, keys - expected
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
        secret = data["transfer_secret"]
        if not isinstance(secret, str) or not _SECRET_RE.match(secret):
            raise ValueError("transfer_secret must be 64 lowercase hex characters")
        sums = data.get("block_checksums", [])
        if not isinstance(sums, list | tuple) or (sums and len(sums) != len(blocks)):
            raise ValueError("block_checksums must be a list of one int per block")
        for c in sums:
            _check_int("block_checksums[]", c, -(2**63), 2**63 - 1)
        return cls(
            engine_id=_check_id("engine_id", data["engine_id"]),
            side_channel=side,
            remote_request_id=_check_id("remote_request_id", data["remote_request_id"]),
            block_ids=tuple(blocks),
            num_tokens=_check_int("num_tokens", data["num_tokens"], 0, 2**31 - 1),
            first_token_id=_check_int("first_token_id", data["first_token_id"], 0, 2**31 - 1),
            lease_seconds=float(lease),
            transfer_secret=secret,
            block_checksums=tuple(sums),
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
