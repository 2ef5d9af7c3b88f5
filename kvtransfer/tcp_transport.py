"""TCP fallback data path over pyzmq.

Prefill binds a ROUTER on ``host``; each decode connects a DEALER whose routing id is its
connection token and says ``[ready, proof]`` once, where the proof is an HMAC of that token under
the cluster token: prefill serves only connections that proved it. A transfer is one multipart
message ``[header, segment_0, ...]`` sent zero-copy from the KV cache (CPU) and copied once on
arrival into the local blocks. The header names the transfer and carries ``auth.data_mac``
(the transfer's secret over its id and sizes); decode copies only when the message came in on
the connection that transfer was opened on and the MAC verifies, and drops (and counts)
anything else before a byte reaches a block. The copy happens on the event loop, so once a
waiter is gone nothing writes its views again.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import warnings

import msgpack
import torch
import zmq
import zmq.asyncio

from tandem.engine.cluster_token import MAC_BYTES
from tandem.engine.kv_connector import FailureReason
from tandem.kvtransfer.auth import FrameAuth, Unauthorized, data_mac, new_xfer_id
from tandem.kvtransfer.transport import TOKEN_BYTES, DropCounter, TransferError

log = logging.getLogger(__name__)

_READY = b"ready"
_LABEL = b"tcp-data"
_MAX_HEADER = 1 << 20


def _host_array(view: torch.Tensor):  # noqa: ANN202 - numpy array, numpy is torch's dependency
    return (view if view.device.type == "cpu" else view.cpu()).numpy()


class TcpSendTransport:
    name = "tcp"

    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth | None = None) -> None:
        self._ctx = ctx
        self._auth = auth or FrameAuth(None)
        self._sock: zmq.asyncio.Socket | None = None
        self._ready: set[bytes] = set()
        self._reader: asyncio.Task[None] | None = None
        self.data_address = ""
        self.refused = 0

    async def start(self, host: str, advertise_host: str, port: int = 0) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # this socket only ever receives "ready"
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{host}:{port}")
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        self.data_address = f"tcp://{advertise_host}:{bound}"
        self._sock = sock
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if (
                len(frames) != 3
                or len(frames[0]) != TOKEN_BYTES
                or frames[1] != _READY
                or len(frames[2]) != MAC_BYTES
            ):
                log.warning("kv tcp data: dropped unexpected frame set (%d frames)", len(frames))
                continue
            if not self._auth.check_connect(_LABEL, frames[0], frames[2]):
                self.refused += 1
                log.warning("kv tcp data: refused a connection without the cluster token")
                continue
            self._ready.add(frames[0])
            try:
                await self._sock.send_multipart([frames[0], _READY])
            except zmq.ZMQError as exc:
                log.warning("kv tcp data: ready ack failed: %s", exc)

    async def send(
        self, peer: bytes, xfer_id: int, views: list[torch.Tensor], timeout: float, mac: bytes
    ) -> None:
        if self._sock is None or peer not in self._ready:
            raise TransferError("tcp data channel of this peer is not connected")
        header = msgpack.packb(
            {"xfer_id": xfer_id, "sizes": [v.numel() for v in views], "mac": mac},
            use_bin_type=True,
        )
        frames = [peer, header, *(_host_array(v) for v in views)]
        try:
            tracker = await asyncio.wait_for(
                self._sock.send_multipart(frames, copy=False, track=True), timeout
            )
        except zmq.ZMQError as exc:
            raise TransferError(f"tcp send failed: {exc}") from None
        except TimeoutError:
            raise TransferError("tcp send timed out (peer not reading)") from None
        # zmq reads the frames from our memory after send returns; the tracker says when done.
        deadline = time.monotonic() + timeout
        for delay in itertools.chain((0.0005, 0.001, 0.002, 0.005), itertools.repeat(0.01)):
            if tracker.done:
                return
            if time.monotonic() >= deadline:
                raise TransferError("tcp send did not complete in time")
            await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class _Waiter:
    __slots__ = ("views", "future", "token", "secret")

    def __init__(
        self, views: list[torch.Tensor], future: asyncio.Future[None], token: bytes, secret: str
    ) -> None:
        self.views = views
        self.future = future
        self.token = token
        self.secret = secret


class TcpRecvTransport:
    name = "tcp"
    cancel_safe = True
    self_delimiting = True

    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth | None = None) -> None:
        self._ctx = ctx
        self._auth = auth or FrameAuth(None)
        self._socks: dict[bytes, zmq.asyncio.Socket] = {}
        self._readers: dict[bytes, asyncio.Task[None]] = {}
        self._waiters: dict[int, _Waiter] = {}
        self.on_dropped: DropCounter | None = None

    def new_xfer_id(self) -> int:
        return new_xfer_id(self._waiters)

    async def connect(self, data_address: str, token: bytes, timeout: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, token)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(data_address)
        try:
            await sock.send_multipart([_READY, self._auth.connect_proof(_LABEL, token)])
            ack = await asyncio.wait_for(sock.recv(), timeout)
        except TimeoutError:
            sock.close(linger=0)
            raise TransferError(
                f"tcp data channel {data_address} did not answer (another cluster token?)"
            ) from None
        if ack != _READY:
            sock.close(linger=0)
            raise TransferError("tcp data channel answered garbage")
        self._socks[token] = sock
        self._readers[token] = asyncio.ensure_future(self._read(sock, token))

    async def _read(self, sock: zmq.asyncio.Socket, token: bytes) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                self._deliver(frames, token)
            except Exception:  # a hostile peer must not kill the reader
                log.exception("kv tcp data: failed to deliver a transfer")

    def _drop(self, reason: FailureReason, why: str) -> None:
        log.warning("kv tcp data: %s; dropped", why)
        if self.on_dropped is not None:
            self.on_dropped(reason)

    def _deliver(self, frames: list[zmq.Frame], token: bytes) -> None:
        """Copy one transfer message into its views, or drop it: only on the connection its
        transfer was opened on, only with a MAC of that transfer's secret, only whole."""
        if len(frames[0]) > _MAX_HEADER:
            self._drop(FailureReason.BAD_MESSAGE, "oversized header")
            return
        try:
            header = msgpack.unpackb(frames[0].bytes, raw=False)
            xfer_id, sizes, mac = header["xfer_id"], header["sizes"], header["mac"]
            if not isinstance(mac, bytes) or not isinstance(sizes, list):
                raise TypeError("mac must be bytes and sizes a list")
        except Exception:
            self._drop(FailureReason.BAD_MESSAGE, "malformed header")
            return
        waiter = self._waiters.get(xfer_id) if type(xfer_id) is int else None
        if waiter is None or waiter.future.done() or waiter.token != token:
            # Never opened here (a guess, a stale id, another peer's transfer): no block is
            # touched, and the transfer it may have aimed at is left alone.
            self._drop(FailureReason.UNKNOWN_TRANSFER, f"transfer {xfer_id!r} is not ours")
            return
        expected = [v.numel() for v in waiter.views]
        try:
            good = hmac.compare_digest(data_mac(waiter.secret, xfer_id, sizes), mac)
        except (Unauthorized, TypeError, OverflowError, ValueError):
            good = False
        if not good:
            # Fails this load, which counts it (reason unauthorized): not counted twice here.
            log.warning("kv tcp data: transfer %s is not authenticated; dropped", xfer_id)
            waiter.future.set_exception(
                TransferError(
                    "data did not prove the transfer's secret", FailureReason.UNAUTHORIZED
                )
            )
            return
        got = [len(f) for f in frames[1:]]
        if sizes != expected or got != expected:
            waiter.future.set_exception(
                TransferError(f"tcp data sizes {got} differ from requested {expected}")
            )
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zmq buffers are read-only; we only read them
            for view, frame in zip(waiter.views, frames[1:], strict=True):
                view.copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
        waiter.future.set_result(None)

    def expect(self, token: bytes, xfer_id: int, views: list[torch.Tensor], secret: str) -> None:
        if token not in self._socks:
            raise TransferError("tcp data channel of this peer is not connected")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[xfer_id] = _Waiter(views, future, token, secret)

    def forget(self, xfer_id: int) -> None:
        self._waiters.pop(xfer_id, None)

    async def wait(self, xfer_id: int, timeout: float) -> None:
        waiter = self._waiters.get(xfer_id)
        if waiter is None:
            raise TransferError(f"transfer {xfer_id} is not expected")
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            raise TransferError("tcp transfer timed out") from None
        finally:
            self._waiters.pop(xfer_id, None)

    async def disconnect(self, token: bytes) -> None:
        reader = self._readers.pop(token, None)
        if reader is not None:
            reader.cancel()
        sock = self._socks.pop(token, None)
        if sock is not None:
            sock.close(linger=0)

    async def close(self) -> None:
        for token in list(self._socks):
            await self.disconnect(token)
        for waiter in self._waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(TransferError("connector closed"))
        self._waiters.clear()
