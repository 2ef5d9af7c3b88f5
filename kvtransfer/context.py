"""State both sides of a connector share: its identity, loop, lock, clock and metrics.

Created by ``ZmqKVConnector``; ``PrefillSide`` and ``DecodeSide`` run their coroutines on
``loop`` (the connector's own thread) and touch engine-visible state only under ``lock``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq.asyncio

from tandem.engine.kv_connector import FailureReason
from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer.auth import FrameAuth
from tandem.kvtransfer.metrics import KVTransferMetrics

log = logging.getLogger(__name__)


class LoadFailure(Exception):
    """Ends a load (or a handshake) with a reason the engine and the metrics see."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class ConnectorContext:
    engine_id: str
    layout: KVLayout
    kv: torch.Tensor
    loop: asyncio.AbstractEventLoop
    zctx: zmq.asyncio.Context
    metrics: KVTransferMetrics | None
    transfer_timeout: float
    handshake_timeout: float
    clock: Callable[[], float]
    auth: FrameAuth = field(default_factory=lambda: FrameAuth(None))
    # The worker's compatibility fingerprint (engine/fingerprint.py) and its readable form:
    # the handshake refuses a peer whose fingerprint differs, before a byte of KV moves.
    fingerprint: str = "unset"
    identity: str = "unset"
    lock: threading.Lock = field(default_factory=threading.Lock)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # Tells the engine thread it has something to take (a finished load, released blocks), so
    # an engine that only waits on the connector takes it now, not at its next poll. Called on
    # any thread, with or without ``lock``: it must only enqueue (EngineThread.wake).
    wake: Callable[[], None] = field(default=lambda: None)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start a task on the loop (call on the loop thread); close() cancels leftovers."""
        task = self.loop.create_task(coro)
        self.tasks.append(task)
        task.add_done_callback(self.tasks.remove)
        return task

    def count_failure(self, reason: FailureReason) -> None:
        if self.metrics is not None:
            self.metrics.add_failure(reason.value)


def log_send_error(fut: asyncio.Future[Any]) -> None:
    """Done-callback for fire-and-forget side-channel sends."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("kv side channel: send failed: %s", fut.exception())
