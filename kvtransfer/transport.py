"""The data-path seam between the connector and its transports (UCX, TCP).

The connector resolves block ids into byte views of the KV cache; a transport only moves bytes
between views. Peers are identified by the decode side's 16-byte connection token, which decode
also uses as its ZMQ routing id on the side channel, so prefill maps a PULL to a data channel.
A data connection is accepted only with a proof of the cluster token (``FrameAuth``), and a
transfer only delivers into the views of the transfer its connection opened, authenticated by
the transfer's secret where the transport carries a header (TCP) and by its random id, which
names the UCX tags, otherwise. Every coroutine here runs on the connector's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tandem.engine.kv_connector import FailureReason

TOKEN_BYTES = 16
DropCounter = Callable[[FailureReason], None]  # the connector counts dropped data this way


class TransferError(RuntimeError):
    """A data-path failure; the message says why (timeout, disconnect, bad data), ``reason``
    what the load's result and the failure metric call it."""

    def __init__(self, message: str, reason: FailureReason = FailureReason.TRANSFER_ERROR) -> None:
        super().__init__(message)
        self.reason = reason


def block_bytes_view(kv_cache: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Flat uint8 view of blocks ``start .. start+count-1``: one contiguous range, no copy."""
    return kv_cache[start : start + count].reshape(-1).view(torch.uint8)


class SendTransport(Protocol):
    """Prefill side: serves pulls from the blocks named by the connector."""

    name: str
    data_address: str  # advertised in HELLO_OK; empty until start() returns

    async def start(self, host: str, advertise_host: str, port: int = 0) -> None:
        """Listen on ``host``:``port`` (0: any free port; a fixed one lets a NetworkPolicy
        name it); ``data_address`` names ``advertise_host`` (what peers dial)."""
        ...

    async def send(
        self, peer: bytes, xfer_id: int, views: list[torch.Tensor], timeout: float, mac: bytes
    ) -> None:
        """Send views[i] as segment i of ``xfer_id``, authenticated by ``mac``
        (``auth.data_mac``) where the transport has a header. Returns once the views may be reused;
        raises TransferError (the views may then still be read for a short while only if the
        transport could not cancel, which it logs)."""
        ...

    async def close(self) -> None: ...


class RecvTransport(Protocol):
    """Decode side: pulls segments straight into the local block views.

    Per transfer: ``expect`` before sending the PULL, then either ``wait`` (after prefill
    accepted) or ``forget`` (it refused). ``cancel_safe`` says whether cancelling ``wait`` stops
    all writes at once (TCP copies on the loop) or whether posted receives must finish (UCX).
    """

    name: str
    cancel_safe: bool
    on_dropped: DropCounter | None  # set by the connector: data refused on arrival
    # True when a completed wait() proves every byte of every segment arrived (TCP checks sizes
    # in its header); False when only prefill's PULL_DONE can say the sends were whole (UCX).
    self_delimiting: bool

    def new_xfer_id(self) -> int:
        """A random transfer id (``auth.new_xfer_id``), unique among all transfers this process
        receives."""
        ...

    async def connect(self, data_address: str, token: bytes, timeout: float) -> None: ...

    def expect(self, token: bytes, xfer_id: int, views: list[torch.Tensor], secret: str) -> None:
        """Only connection ``token`` may fill these views, and only with data that ``secret``
        authenticates."""
        ...

    def forget(self, xfer_id: int) -> None: ...

    async def wait(self, xfer_id: int, timeout: float) -> None:
        """Fill the expected views. Raises TransferError; in every outcome it returns only when
        nothing will write to the views any more (unless cancelled and ``cancel_safe``)."""
        ...

    async def disconnect(self, token: bytes) -> None: ...

    async def close(self) -> None: ...
