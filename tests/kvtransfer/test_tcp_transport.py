"""The TCP receive path refuses partial or mis-sized transfers and never writes their bytes."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from tandem.engine.kv_connector import FailureReason
from tandem.kvtransfer.auth import data_mac
from tandem.kvtransfer.tcp_transport import TcpRecvTransport
from tandem.kvtransfer.transport import TransferError

TOKEN = b"t" * 16
SECRET = "7a" * 32


def _frames(
    xfer_id: object, sizes: object, payloads: list[bytes], secret: str = SECRET
) -> list[zmq.Frame]:
    mac = data_mac(secret, xfer_id, sizes) if type(xfer_id) is int else b"x" * 32
    header = msgpack.packb({"xfer_id": xfer_id, "sizes": sizes, "mac": mac}, use_bin_type=True)
    return [zmq.Frame(header), *(zmq.Frame(b) for b in payloads)]


async def _deliver(
    frames: list[zmq.Frame],
    views: list[torch.Tensor],
    via: bytes = TOKEN,
    dropped: list[FailureReason] | None = None,
) -> None:
    """Expect transfer 7 on connection TOKEN; deliver ``frames`` as if read on ``via``."""
    recv = TcpRecvTransport(zmq.asyncio.Context.instance())
    recv.on_dropped = (dropped if dropped is not None else []).append
    recv._socks[TOKEN] = None  # type: ignore[assignment]  # no socket needed for _deliver
    recv.expect(TOKEN, 7, views, SECRET)
    recv._deliver(frames, via)
    try:
        await recv.wait(7, timeout=0.2)
    finally:
        recv._socks.clear()


def test_whole_transfer_is_copied() -> None:
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    asyncio.run(_deliver(_frames(7, [8, 4], [b"abcdefgh", b"wxyz"]), [a, b]))
    assert bytes(a.numpy()) == b"abcdefgh" and bytes(b.numpy()) == b"wxyz"


@pytest.mark.parametrize(
    "frames",
    [
        _frames(7, [8, 4], [b"abcdefgh", b"wx"]),  # short segment, header lies
        _frames(7, [8, 2], [b"abcdefgh", b"wx"]),  # header agrees but not what we asked for
        _frames(7, [8], [b"abcdefgh"]),  # a segment missing
        _frames(7, [8, 4, 1], [b"abcdefgh", b"wxyz", b"!"]),  # one too many
    ],
)
def test_partial_or_missized_transfer_fails_and_writes_nothing(frames: list[zmq.Frame]) -> None:
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(TransferError, match="differ"):
        asyncio.run(_deliver(frames, [a, b]))
    assert not a.any() and not b.any()


@pytest.mark.parametrize(
    "frames",
    [
        _frames(8, [8, 4], [b"abcdefgh", b"wxyz"]),  # another transfer's id
        _frames("7", [8, 4], [b"abcdefgh", b"wxyz"]),  # wrong type
        [zmq.Frame(b"\xc1garbage"), zmq.Frame(b"abcdefgh"), zmq.Frame(b"wxyz")],
    ],
)
def test_unknown_or_garbled_transfer_is_dropped(frames: list[zmq.Frame]) -> None:
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(TransferError, match="timed out"):
        asyncio.run(_deliver(frames, [a, b]))
    assert not a.any() and not b.any()


def test_data_without_the_transfer_secret_fails_the_transfer_and_writes_nothing() -> None:
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    dropped: list[FailureReason] = []
    forged = _frames(7, [8, 4], [b"abcdefgh", b"wxyz"], secret="00" * 32)
    with pytest.raises(TransferError, match="secret") as e:
        asyncio.run(_deliver(forged, [a, b], dropped=dropped))
    assert e.value.reason == FailureReason.UNAUTHORIZED  # the load's result counts it
    assert not a.any() and not b.any()
    assert dropped == []


def test_data_on_another_connection_is_dropped_and_counted() -> None:
    """A peer (even one decode also pulls from) cannot feed a transfer opened elsewhere."""
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    dropped: list[FailureReason] = []
    frames = _frames(7, [8, 4], [b"abcdefgh", b"wxyz"])
    with pytest.raises(TransferError, match="timed out"):
        asyncio.run(_deliver(frames, [a, b], via=b"r" * 16, dropped=dropped))
    assert not a.any() and not b.any()
    assert dropped == [FailureReason.UNKNOWN_TRANSFER]
