"""The KV connector: a ZMQ side channel plus a data transport, for prefill, decode or both.

Threads: the engine thread calls the ``KVConnector`` methods; the connector runs its sockets on
its own thread and asyncio loop (UCX work additionally runs on the process's UCX thread). They
meet only in state guarded by ``ctx.lock`` and in ``call_soon_threadsafe``: no engine call
waits on the network. ``PrefillSide`` and ``DecodeSide`` hold the two halves of the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
import zmq.asyncio

from tandem.engine.kv_connector import KVTransferParams, LoadResult
from tandem.engine.kv_layout import KVLayout
from tandem.engine.role import Role
from tandem.kvtransfer.auth import FrameAuth
from tandem.kvtransfer.context import ConnectorContext
from tandem.kvtransfer.decode_side import DecodeSide
from tandem.kvtransfer.metrics import KVTransferMetrics
from tandem.kvtransfer.prefill_side import PrefillSide
from tandem.kvtransfer.transport import RecvTransport, SendTransport

log = logging.getLogger(__name__)
T = TypeVar("T")


class ZmqKVConnector:
    """Implements ``tandem.engine.kv_connector.KVConnector`` (the contract the role hooks use).

    Built by ``create_connector``; the caller owns it and must ``close()`` it. ``kv_cache`` stays
    the engine's: the connector reads published blocks and writes loaded ones, nothing else.
    ``role`` PREFILL serves pulls, DECODE pulls, COLOCATED does both.
    """

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        role: Role,
        engine_id: str,
        send: SendTransport | None,
        recv: RecvTransport | None,
        zctx: zmq.asyncio.Context,
        host: str,
        side_channel_port: int,
        lease_seconds: float,
        metrics: KVTransferMetrics | None,
        transfer_timeout: float,
        handshake_timeout: float,
        advertise_host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth: FrameAuth | None = None,
        data_port: int = 0,
        fingerprint: str = "unset",
        identity: str = "unset",
        wake: Callable[[], None] | None = None,
    ) -> None:
        layout.check_kv_cache(kv_cache)
        if (send is not None) != (role != Role.DECODE) or (recv is not None) != (
            role != Role.PREFILL
        ):
            raise ValueError("transports do not match the role")
        self.engine_id = engine_id
        self.layout = layout
        self.role = role
        self._lease_seconds = lease_seconds
        self._closed = False
        self._close_lock = threading.Lock()
        loop = asyncio.new_event_loop()
        self._ctx = ConnectorContext(
            engine_id=self.engine_id,
            layout=layout,
            kv=kv_cache,
            loop=loop,
            zctx=zctx,
            metrics=metrics,
            transfer_timeout=transfer_timeout,
            handshake_timeout=handshake_timeout,
            clock=clock,
            auth=auth or FrameAuth(None),
            fingerprint=fingerprint,
            identity=identity[:1024],
        )
        if wake is not None:
            self._ctx.wake = wake
        if recv is not None:
            recv.on_dropped = self._ctx.count_failure
        self._prefill = PrefillSide(self._ctx, send, lease_seconds) if send else None
        self._decode = DecodeSide(self._ctx, recv) if recv else None
        self._transport = (send or recv).name  # type: ignore[union-attr]
        self._thread = threading.Thread(target=loop.run_forever, name="kv-connector", daemon=True)
        self._thread.start()
        try:
            self._call(
                self._start(host, side_channel_port, advertise_host or host, data_port),
                timeout=30.0,
            )
        except BaseException:
            self.close()
            raise

    @property
    def side_channel_address(self) -> str | None:
        """``tcp://host:port`` of the prefill side channel; None for a decode-only connector."""
        return self._prefill.side_channel_address if self._prefill else None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._ctx.kv

    @property
    def transport(self) -> str:
        return self._transport

    # ----- engine-facing API (engine thread) -------------------------------------------------

    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        if self._prefill is None:
            raise RuntimeError("publish needs a connector with the prefill role")
        return self._prefill.publish(request_id, block_ids, num_tokens, first_token_id)

    def take_released(self) -> list[str]:
        return self._prefill.take_released() if self._prefill else []

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        if self._decode is None:
            raise RuntimeError("start_load needs a connector with the decode role")
        self._decode.start_load(request_id, params, remote_block_ids, local_block_ids)

    def hold(self, request_id: str, params: KVTransferParams) -> None:
        if self._decode is None:
            raise RuntimeError("hold needs a connector with the decode role")
        self._decode.hold(request_id, params)

    def take_finished_loads(self) -> list[LoadResult]:
        return self._decode.take_finished_loads() if self._decode else []

    def abort(self, request_id: str) -> None:
        if self._prefill is not None:
            self._prefill.abort(request_id)
        if self._decode is not None:
            self._decode.abort(request_id)

    def in_flight(self, request_id: str) -> int:
        """Prefill: transfers now reading ``request_id``'s blocks (tests, diagnostics)."""
        return self._prefill.in_flight(request_id) if self._prefill else 0

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        loop = self._ctx.loop
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._shutdown(), timeout=15.0)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive() and not loop.is_closed():
            loop.close()
        if self._decode is not None:
            self._decode.fail_remaining()

    # ----- loop plumbing ---------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._ctx.loop).result(timeout)

    async def _start(self, host: str, port: int, advertise_host: str, data_port: int) -> None:
        if self._prefill is not None:
            await self._prefill.start(host, port, advertise_host, data_port)
        self._ctx.spawn(self._ticker())

    async def _shutdown(self) -> None:
        if self._decode is not None:
            await self._decode.close()
        for task in list(self._ctx.tasks):
            task.cancel()
        if self._prefill is not None:
            await self._prefill.close()

    async def _ticker(self) -> None:
        interval = min(0.25, self._lease_seconds / 5)
        while True:
            await asyncio.sleep(interval)
            try:
                if self._prefill is not None:
                    self._prefill.tick()
                if self._decode is not None:
                    self._decode.tick()
            except Exception:
                log.exception("kv connector tick failed")
