"""The simulated data path: the profiled transfer time, no bytes (simulated workers only).

The side channel stays the real one (handshake with the KV layout, PULL, PULL_ACCEPTED,
PULL_DONE, renewals, releases, leases, all sealed with the cluster token); only the data
transport is replaced. The prefill side's
``send`` waits ``seconds(bytes)`` for the views it was given (views of a meta tensor: sized, never
read), and the decode side learns that the transfer is whole from prefill's PULL_DONE, as over
UCX (``self_delimiting`` False). Nothing is written, so cancelling a wait is always safe. The
transport names itself ``sim``: a simulated worker never pairs with a real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from tandem.kvtransfer.auth import new_xfer_id
from tandem.kvtransfer.transport import DropCounter, TransferError

SIM = "sim"


def _num_bytes(views: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in views)


class SimSendTransport:
    name = SIM

    def __init__(self, seconds: Callable[[int], float]) -> None:
        self._seconds = seconds
        self.data_address = ""
        self.num_bytes_sent = 0

    async def start(self, host: str, advertise_host: str, port: int = 0) -> None:
        self.data_address = f"sim://{advertise_host}"

    async def send(
        self, peer: bytes, xfer_id: int, views: list[torch.Tensor], timeout: float, mac: bytes
    ) -> None:
        n = _num_bytes(views)
        seconds = self._seconds(n)
        if seconds > timeout:
            await asyncio.sleep(timeout)
            raise TransferError(f"simulated transfer of {n} bytes takes {seconds:.3f} s > timeout")
        await asyncio.sleep(seconds)
        self.num_bytes_sent += n

    async def close(self) -> None:
        return None


class SimRecvTransport:
    name = SIM
    cancel_safe = True
    self_delimiting = False

    def __init__(self) -> None:
        self._peers: set[bytes] = set()
        self._expected: dict[int, bytes] = {}
        self.on_dropped: DropCounter | None = None  # nothing arrives, so nothing is dropped

    def new_xfer_id(self) -> int:
        return new_xfer_id(self._expected)

    async def connect(self, data_address: str, token: bytes, timeout: float) -> None:
        if not data_address.startswith("sim://"):
            raise TransferError(f"{data_address!r} is not a simulated data channel")
        self._peers.add(token)

    def expect(self, token: bytes, xfer_id: int, views: list[torch.Tensor], secret: str) -> None:
        if token not in self._peers:
            raise TransferError("simulated data channel of this peer is not connected")
        self._expected[xfer_id] = token

    def forget(self, xfer_id: int) -> None:
        self._expected.pop(xfer_id, None)

    async def wait(self, xfer_id: int, timeout: float) -> None:
        # Nothing arrives on this path: completion is prefill's PULL_DONE (self_delimiting False).
        if xfer_id not in self._expected:
            raise TransferError(f"transfer {xfer_id} is not expected")

    async def disconnect(self, token: bytes) -> None:
        self._peers.discard(token)

    async def close(self) -> None:
        self._peers.clear()
        self._expected.clear()
