"""Decode side of the side channel: one ``PeerLink`` per prefill engine that decode pulls from.

A link owns a ZMQ DEALER socket (routing id = the decode's 16-byte data-channel token), a monitor
that notices the prefill going away, and three tasks: the handshake (HELLO, layout and transport
checked on both ends, then the data channel connected), the reader that routes replies to the
transfers waiting for them, and the watcher. Every frame is sealed with the cluster token and every
reply opened only if its MAC verifies. ``close`` fails everything still waiting on the link. Every
method runs on the connector's event loop; ``DecodeSide`` keeps the table of links and the load
lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.engine.kv_layout import layout_mismatch
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import FrameAuth
from tandem.kvtransfer.context import ConnectorContext, LoadFailure, log_send_error
from tandem.kvtransfer.transport import RecvTransport, TransferError

log = logging.getLogger(__name__)


class Interruptible(Protocol):
    """A load registered on a link: the link interrupts it when prefill aborts or goes away."""

    params: KVTransferParams
    last_renew: float

    def interrupt(self, failure: LoadFailure) -> None: ...


@dataclass(slots=True)
class Held:
    """A request decode has admitted but not yet allocated blocks for: keep its lease alive."""

    params: KVTransferParams
    last_renew: float = 0.0


@dataclass(slots=True)
class PeerLink:
    address: str
    token: bytes
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # EVENT_DISCONNECTED of sock: prefill died or restarted
    hello: asyncio.Future[p.HelloOk]  # the prefill's answer (set by the reader)
    ready: asyncio.Future[p.HelloOk]  # answer checked and data channel connected
    on_closed: Callable[[PeerLink], None]
    engine_id: str | None = None
    # per transfer: (answer to PULL, PULL_DONE); both registered up front since replies can
    # arrive before the load's coroutine resumes
    waiters: dict[int, tuple[asyncio.Future[p.Message], asyncio.Future[p.Message]]] = field(
        default_factory=dict
    )
    loads: dict[str, Interruptible] = field(default_factory=dict)  # by remote request id
    held: dict[str, Held] = field(default_factory=dict)  # by remote request id
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False
    _ctx: ConnectorContext | None = None
    _recv: RecvTransport | None = None

    @classmethod
    def open(
        cls,
        ctx: ConnectorContext,
        recv: RecvTransport,
        address: str,
        on_closed: Callable[[PeerLink], None],
    ) -> PeerLink:
        """Connect to a prefill side channel and start the handshake (call on the loop)."""
        token = uuid.uuid4().bytes
        sock = ctx.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, token)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        link = cls(
            address,
            token,
            sock,
            monitor,
            ctx.loop.create_future(),
            ctx.loop.create_future(),
            on_closed,
            _ctx=ctx,
            _recv=recv,
        )
        link.tasks.append(ctx.spawn(link._handshake()))
        link.tasks.append(ctx.spawn(link._read()))
        link.tasks.append(ctx.spawn(link._watch()))
        return link

    def send(self, msg: p.Message) -> None:
        if self.closed:
            return
        fut = self.sock.send(p.seal(msg, ctx_auth(self._ctx)))
        fut.add_done_callback(log_send_error)

    async def _handshake(self) -> None:
        ctx, recv = self._ctx, self._recv
        assert ctx is not None and recv is not None
        self.send(p.Hello(ctx.engine_id, recv.name, ctx.layout))
        try:
            reply = await asyncio.shield(self.hello)
            await recv.connect(reply.data_address, self.token, ctx.handshake_timeout)
        except (LoadFailure, TransferError) as exc:
            failure = (
                exc
                if isinstance(exc, LoadFailure)
                else LoadFailure(FailureReason.HANDSHAKE, str(exc))
            )
            await self.close(failure)
            return
        self.engine_id = reply.engine_id
        set_future(self.ready, reply)

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                self._on_frames(frames)
            except Exception:
                log.exception("kv side channel: peer handler failed")

    def _on_frames(self, frames: list[bytes]) -> None:
        ctx = self._ctx
        assert ctx is not None
        if len(frames) != 1:
            log.warning("kv side channel: dropped a %d-frame reply", len(frames))
            ctx.count_failure(FailureReason.BAD_MESSAGE)
            return
        try:
            msg = p.unseal(frames[0], ctx.auth)
        except p.ProtocolError as exc:
            if exc.code == "unauthorized":
                detail = (
                    f"{self.address} answered with a frame not signed with our cluster token "
                    "(it has another token?)"
                )
                log.warning("kv side channel: %s", detail)
                ctx.count_failure(FailureReason.UNAUTHORIZED)
                if not self.hello.done():
                    set_future(self.hello, LoadFailure(FailureReason.UNAUTHORIZED, detail))
                return
            log.warning("kv side channel: bad reply from %s: %s", self.address, exc)
            ctx.count_failure(FailureReason.BAD_MESSAGE)
            return
        log.debug("kv side channel: %s from %s", type(msg).__name__, self.address)
        match msg:
            case p.HelloOk():
                problem = layout_mismatch(ctx.layout, msg.layout)
                if problem is not None:
                    set_future(self.hello, LoadFailure(FailureReason.LAYOUT_MISMATCH, problem))
                elif self._recv is None or msg.transport != self._recv.name:
                    set_future(
                        self.hello,
                        LoadFailure(FailureReason.HANDSHAKE, f"prefill uses {msg.transport}"),
                    )
                else:
                    set_future(self.hello, msg)
            case p.PullAccepted() | p.PullDone() | p.Error() if msg.xfer_id is not None:
                futures = self.waiters.get(msg.xfer_id, ())
                if isinstance(msg, p.PullDone):
                    futures = futures[1:]
                for fut in futures:
                    if not fut.done():
                        fut.set_result(msg)
                        break
            case p.Error():
                log.warning("kv side channel: %s says %s: %s", self.address, msg.code, msg.message)
                if not self.hello.done():
                    reason = (
                        FailureReason.LAYOUT_MISMATCH
                        if msg.code == "layout_mismatch"
                        else FailureReason.HANDSHAKE
                    )
                    set_future(self.hello, LoadFailure(reason, msg.message))
            case p.Aborted():
                load = self.loads.get(msg.request_id)
                if load is not None and msg.engine_id == load.params.engine_id:
                    load.interrupt(
                        LoadFailure(
                            FailureReason.PEER_ABORTED, f"prefill released it: {msg.reason}"
                        )
                    )
            case _:
                log.warning("kv side channel: unexpected %s from prefill", type(msg).__name__)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                break
        await self.close(
            LoadFailure(
                FailureReason.PEER_DISCONNECTED,
                f"side channel to {self.address} disconnected (prefill died?)",
            )
        )

    async def close(self, failure: LoadFailure) -> None:
        """Fail every waiter and load on this link, stop its tasks and close its sockets."""
        if self.closed:
            return
        self.closed = True
        self.on_closed(self)
        set_future(self.hello, failure)
        set_future(self.ready, failure)
        for load in list(self.loads.values()):
            load.interrupt(failure)
        for futures in self.waiters.values():
            for fut in futures:
                if not fut.done():
                    fut.set_result(p.Error(failure.reason.value, failure.detail, None, None))
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        if self._recv is not None:
            with contextlib.suppress(TransferError):
                await self._recv.disconnect(self.token)
        # libzmq's I/O thread sends monitor events with a blocking send: stop the monitor before
        # its reading end goes away, or one late event wedges every socket of the context.
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def ctx_auth(ctx: ConnectorContext | None) -> FrameAuth:
    assert ctx is not None
    return ctx.auth


def set_future(fut: asyncio.Future[p.HelloOk], value: p.HelloOk | LoadFailure) -> None:
    if fut.done():
        return
    if isinstance(value, LoadFailure):
        fut.set_exception(value)
        fut.exception()  # mark retrieved: whoever awaits re-raises it
    else:
        fut.set_result(value)
