"""UCX data path through ucxx.

ucxx keeps one UCX context and worker per process and binds its futures to the event loop that
first uses it, so all UCX work of a process runs on one dedicated thread and loop
(``UcxRuntime``, shared by every connector in the process). Connectors submit coroutines to it.

Prefill listens; decode connects one endpoint per prefill engine and sends its 16-byte token with an
HMAC of it under the cluster token on the endpoint's own (peer-info) tags, so prefill maps side-
channel PULLs to endpoints and serves only endpoints that proved the token (and never lets a second
endpoint take over a live token). Segment i of transfer x travels with the forced tag ``x << 20 |
i``; transfer ids are random (``auth.new_xfer_id``) and unique per receiving process, so tags never
collide on the shared worker and no peer can aim data at a transfer it was not told about: data with
an unknown tag never matches a posted receive. ucxx 0.52's ``create_listener`` takes no bind
address, so the UCX listener listens on every interface; the proof above and the NetworkPolicy
(docs/security.md) are what restrict it. Decode posts its receives directly on the local KV-cache
views (host memory, or device memory through __cuda_array_interface__ where UCX has CUDA
transports): the payload never becomes a Python object."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import torch

from tandem.engine.cluster_token import MAC_BYTES
from tandem.kvtransfer.auth import FrameAuth, new_xfer_id
from tandem.kvtransfer.transport import TOKEN_BYTES, DropCounter, TransferError

log = logging.getLogger(__name__)

T = TypeVar("T")
SEGMENT_BITS = 20
_CANCEL_GRACE_S = 5.0
# ucxx waits this long (ns) for the progress thread when closing an endpoint; its 10 s default
# would stall the shared UCX loop for every other connector in the process.
_ABORT_PERIOD_NS = 100_000_000


_UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
_LABEL = b"ucx-data"
_HELLO_BYTES = TOKEN_BYTES + MAC_BYTES


def _buffer(view: torch.Tensor) -> Any:
    # numpy exposes __array_interface__ for host memory; torch CUDA tensors expose
    # __cuda_array_interface__ themselves. Both are zero-copy views.
    return view.numpy() if view.device.type == "cpu" else view


class UcxRuntime:
    """The process's UCX thread and event loop. Created on first use, never torn down: ucxx
    cannot be re-initialised safely while endpoints of other connectors may still exist."""

    _lock = threading.Lock()
    _instance: UcxRuntime | None = None

    def __init__(self) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        # UCX's TCP transport moves 8 KiB / 64 KiB segments by default; KV pulls are MiB-sized
        # and 1 MiB segments doubled throughput in benchmarks/kv_transfer.py. The environment
        # (UCX_TLS, UCX_TCP_*, UCX_RNDV_*) still wins: setdefault only fills what is unset.
        for key, value in _UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import ucxx  # imported lazily: the tcp transport must work without UCX

        self.ucxx = ucxx
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ucx", daemon=True)
        self._thread.start()
        self._xfer_ids: set[int] = set()
        self._ids_lock = threading.Lock()

    @classmethod
    def get(cls) -> UcxRuntime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = UcxRuntime()
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the UCX loop from another loop. Cancelling the caller does not
        cancel the UCX side: its coroutines always clean up their own requests."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(coro)))

    def new_xfer_id(self) -> int:
        """Random and unique in this process until ``release_xfer_id``."""
        with self._ids_lock:
            xfer = new_xfer_id(self._xfer_ids)
            self._xfer_ids.add(xfer)
            return xfer

    def release_xfer_id(self, xfer_id: int) -> None:
        with self._ids_lock:
            self._xfer_ids.discard(xfer_id)


def _tag(xfer_id: int, segment: int) -> int:
    return (xfer_id << SEGMENT_BITS) | segment


async def _finish(tasks: list[asyncio.Future[Any]], timeout: float, ep: Any, what: str) -> None:
    """Wait for all UCX requests; on timeout abort the endpoint so none stays posted."""
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    if pending:
        ep.abort(period=_ABORT_PERIOD_NS)  # cancels every request in flight on this endpoint
        await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)
        for t in pending:
            if not t.done():
                log.error("kv ucx: %s request still pending after endpoint abort", what)
        raise TransferError(f"ucx {what} timed out")
    for t in done:
        if t.exception() is not None:
            raise TransferError(f"ucx {what} failed: {t.exception()}")


class UcxSendTransport:
    name = "ucx"

    def __init__(self, runtime: UcxRuntime, auth: FrameAuth | None = None) -> None:
        self._rt = runtime
        self._auth = auth or FrameAuth(None)
        self._listener: Any = None
        self._eps: dict[bytes, Any] = {}
        self.data_address = ""
        self.refused = 0

    async def start(self, host: str, advertise_host: str, port: int = 0) -> None:
        # ucxx listeners bind every interface (no address parameter); the connect proof and
        # the NetworkPolicy restrict who gets served. ``host`` binds the side channel.
        async def listen() -> Any:
            return self._rt.ucxx.create_listener(self._on_connect, port=port)

        self._listener = await self._rt.run(listen())
        self.data_address = f"{advertise_host}:{self._listener.port}"

    async def _on_connect(self, ep: Any) -> None:
        hello = np.zeros(_HELLO_BYTES, dtype=np.uint8)
        try:
            await asyncio.wait_for(ep.recv(hello), 10.0)
            raw = hello.tobytes()
            token, proof = raw[:TOKEN_BYTES], raw[TOKEN_BYTES:]
            live = self._eps.get(token)
            if not self._auth.check_connect(_LABEL, token, proof) or (
                live is not None and not live.closed
            ):
                self.refused += 1
                log.warning("kv ucx: refused an endpoint without the cluster token")
                ep.abort(period=_ABORT_PERIOD_NS)
                return
            self._eps[token] = ep
            await ep.send(np.ones(1, dtype=np.uint8))
        except Exception as exc:
            log.warning("kv ucx: incoming endpoint failed its token exchange: %s", exc)

    async def send(
        self, peer: bytes, xfer_id: int, views: list[torch.Tensor], timeout: float, mac: bytes
    ) -> None:
        # ``mac`` is for transports with a header; here the random transfer id in the tag is
        # what only the puller knows.
        async def go() -> None:
            ep = self._eps.get(peer)
            if ep is None or ep.closed:
                raise TransferError("ucx endpoint of this peer is not connected")
            tasks = [
                asyncio.ensure_future(ep.send(_buffer(v), tag=_tag(xfer_id, i), force_tag=True))
                for i, v in enumerate(views)
            ]
            try:
                await _finish(tasks, timeout, ep, "send")
            except TransferError:
                self._eps.pop(peer, None)
                raise

        await self._rt.run(go())

    async def close(self) -> None:
        async def go() -> None:
            for ep in self._eps.values():
                ep.abort(period=_ABORT_PERIOD_NS)
            self._eps.clear()
            if self._listener is not None:
                self._listener.close()

        await self._rt.run(go())


class UcxRecvTransport:
    name = "ucx"
    cancel_safe = False
    self_delimiting = False

    def __init__(self, runtime: UcxRuntime, auth: FrameAuth | None = None) -> None:
        self._rt = runtime
        self._auth = auth or FrameAuth(None)
        self._eps: dict[bytes, Any] = {}  # touched only on the UCX loop
        self._expected: dict[int, tuple[bytes, list[torch.Tensor]]] = {}  # connector loop only
        self.on_dropped: DropCounter | None = None

    def new_xfer_id(self) -> int:
        return self._rt.new_xfer_id()

    async def connect(self, data_address: str, token: bytes, timeout: float) -> None:
        host, _, port = data_address.rpartition(":")

        async def go() -> None:
            ep = await asyncio.wait_for(self._rt.ucxx.create_endpoint(host, int(port)), timeout)
            ack = np.zeros(1, dtype=np.uint8)
            hello = token + self._auth.connect_proof(_LABEL, token)
            try:
                await ep.send(np.frombuffer(hello, dtype=np.uint8))
                await asyncio.wait_for(ep.recv(ack), timeout)
            except Exception:
                ep.abort(period=_ABORT_PERIOD_NS)
                raise
            self._eps[token] = ep

        try:
            await self._rt.run(go())
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"ucx connect to {data_address} failed: {exc!r}") from None

    def expect(self, token: bytes, xfer_id: int, views: list[torch.Tensor], secret: str) -> None:
        self._expected[xfer_id] = (token, views)

    def forget(self, xfer_id: int) -> None:
        self._expected.pop(xfer_id, None)
        self._rt.release_xfer_id(xfer_id)

    async def wait(self, xfer_id: int, timeout: float) -> None:
        entry = self._expected.pop(xfer_id, None)
        if entry is None:
            raise TransferError(f"transfer {xfer_id} is not expected")
        token, views = entry

        async def go() -> None:
            ep = self._eps.get(token)
            if ep is None or ep.closed:
                raise TransferError("ucx endpoint of this peer is not connected")
            tasks = [
                asyncio.ensure_future(ep.recv(_buffer(v), tag=_tag(xfer_id, i), force_tag=True))
                for i, v in enumerate(views)
            ]
            try:
                await _finish(tasks, timeout, ep, "recv")
            except TransferError:
                self._eps.pop(token, None)
                raise

        await self._rt.run(go())

    async def disconnect(self, token: bytes) -> None:
        async def go() -> None:
            ep = self._eps.pop(token, None)
            if ep is not None:
                ep.abort(period=_ABORT_PERIOD_NS)

        await self._rt.run(go())

    async def close(self) -> None:
        for token in list(self._eps):
            await self.disconnect(token)
