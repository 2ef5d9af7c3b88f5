"""The KV connector: ZMQ side channel, leases (prefill) and pulls (decode) over a data transport.

Threads: the engine thread calls the ``KVConnector`` methods; this connector runs its sockets on
its own thread and asyncio loop (UCX work additionally runs on the process's UCX thread). The
two meet only in state guarded by ``self._lock`` and in ``call_soon_threadsafe``; no engine call
waits on the network.

Prefill: ``publish`` puts the blocks under a lease; decode's PULL is validated (engine id,
known request, blocks in range and owned by that request) and answered PULL_ACCEPTED, then the
segments, then PULL_DONE. Decode: a load handshakes with the prefill engine once (layout
check), sends PULL, posts its receives after PULL_ACCEPTED, and succeeds only when every byte
arrived and prefill reported success; it then tells prefill to release. Any failure ends the
load with a reason and releases on prefill (best effort: the lease covers a lost message).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.lease import LeaseTable, Released
from tandem.kvtransfer.metrics import KVTransferMetrics
from tandem.kvtransfer.transport import (
    TOKEN_BYTES,
    RecvTransport,
    SendTransport,
    TransferError,
    block_bytes_view,
)
from tandem.kvtransfer.types import (
    FailureReason,
    KVLayout,
    KVTransferParams,
    LoadResult,
    layout_mismatch,
)
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

_RELEASE_REASON = {
    p.ReleaseKind.DONE: None,
    p.ReleaseKind.FAILED: FailureReason.TRANSFER_ERROR,
    p.ReleaseKind.ABORTED: FailureReason.PEER_ABORTED,
}


class Role(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    BOTH = 3


class LoadFailure(Exception):
    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class _Published:
    block_ids: frozenset[int]
    peer: bytes | None = None  # the decode that pulled, told if prefill aborts or expires


@dataclass(slots=True)
class _Load:
    request_id: str
    params: KVTransferParams
    runs: list[tuple[int, int, int]]
    interrupt: asyncio.Future[LoadFailure] | None = None
    receiving: bool = False
    aborted: bool = False
    last_renew: float = 0.0
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Peer:
    address: str
    token: bytes
    sock: zmq.asyncio.Socket
    hello: asyncio.Future[p.HelloOk]  # the prefill's answer (set by the reader)
    ready: asyncio.Future[p.HelloOk]  # answer checked and data channel connected
    engine_id: str | None = None
    # per transfer: (answer to PULL, PULL_DONE); both registered up front since replies can
    # arrive before the load's coroutine resumes
    waiters: dict[int, tuple[asyncio.Future[p.Message], asyncio.Future[p.Message]]] = field(
        default_factory=dict
    )
    loads: dict[str, _Load] = field(default_factory=dict)  # by remote request id
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False


class ZmqKVConnector:
    """See ``tandem.kvtransfer.types.KVConnector`` for the engine-facing contract."""

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        role: Role,
        send: SendTransport | None,
        recv: RecvTransport | None,
        zctx: zmq.asyncio.Context,
        host: str,
        side_channel_port: int,
        lease_seconds: float,
        metrics: KVTransferMetrics | None,
        transfer_timeout: float,
        handshake_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        layout.check_kv_cache(kv_cache)
        self.engine_id = uuid.uuid4().hex
        self.layout = layout
        self.role = role
        self.side_channel_address: str | None = None
        self._kv = kv_cache
        self._send_t = send
        self._recv_t = recv
        self._zctx = zctx
        self._lease_seconds = lease_seconds
        self._metrics = metrics
        self._transfer_timeout = transfer_timeout
        self._handshake_timeout = handshake_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._leases = LeaseTable(stuck_grace=transfer_timeout + 5.0)
        self._published: dict[str, _Published] = {}
        self._released: list[str] = []
        self._loads: dict[str, _Load] = {}
        self._finished: list[LoadResult] = []
        self._peers: dict[str, _Peer] = {}
        self._hello_peers: set[bytes] = set()
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kv-connector", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._start(host, side_channel_port), timeout=30.0)
        except BaseException:
            self.close()
            raise

    @property
    def kv_cache(self) -> torch.Tensor:
        """The engine's KV cache tensor this connector reads (prefill) and writes (decode)."""
        return self._kv

    @property
    def transport(self) -> str:
        t = self._send_t or self._recv_t
        assert t is not None
        return t.name

    # ----- engine-facing API (engine thread) -------------------------------------------------

    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        if self.side_channel_address is None:
            raise RuntimeError("publish needs a connector with the prefill role")
        if any(type(b) is not int or not 0 <= b < self.layout.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range [0, {self.layout.num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block ids must not repeat")
        params = KVTransferParams.from_dict(
            {
                "engine_id": self.engine_id,
                "side_channel": self.side_channel_address,
                "remote_request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
                "first_token_id": first_token_id,
                "lease_seconds": self._lease_seconds,
            }
        )
        with self._lock:
            self._leases.add(request_id, self._clock(), self._lease_seconds)
            self._published[request_id] = _Published(frozenset(block_ids))
        return params

    def take_released(self) -> list[str]:
        with self._lock:
            self._apply_released(self._leases.expire(self._clock()))
            out, self._released = self._released, []
        return out

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        if self._recv_t is None:
            raise RuntimeError("start_load needs a connector with the decode role")
        published = set(params.block_ids)
        if any(b not in published for b in remote_block_ids):
            raise ValueError("remote_block_ids must be a subset of params.block_ids")
        if any(type(b) is not int or not 0 <= b < self.layout.num_blocks for b in local_block_ids):
            raise ValueError(f"local block ids out of range [0, {self.layout.num_blocks})")
        if len(set(local_block_ids)) != len(local_block_ids) or len(set(remote_block_ids)) != len(
            remote_block_ids
        ):
            raise ValueError("block ids must not repeat")
        runs = p.plan_segments(remote_block_ids, local_block_ids)  # ValueError on length
        load = _Load(request_id, params, runs)
        with self._lock:
            if self._closed:
                raise RuntimeError("connector is closed")
            if request_id in self._loads:
                raise ValueError(f"request {request_id!r} already has a load in progress")
            self._loads[request_id] = load
        self._loop.call_soon_threadsafe(self._spawn, self._run_load(load))

    def take_finished_loads(self) -> list[LoadResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._published:
                self._apply_released(
                    self._leases.release(request_id, FailureReason.ABORTED, self._clock())
                )
            load = self._loads.get(request_id)
        if load is not None:
            self._loop.call_soon_threadsafe(
                self._interrupt, load, LoadFailure(FailureReason.ABORTED, "aborted by decode")
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._shutdown(), timeout=15.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        with self._lock:
            for rid in list(self._loads):
                self._finish_load(rid, LoadFailure(FailureReason.CLOSED, "connector closed"))

    # ----- loop plumbing ---------------------------------------------------------------------

    def _call(self, coro, timeout: float):  # noqa: ANN001, ANN202 - any coroutine/result
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _spawn(self, coro) -> asyncio.Task[None]:  # noqa: ANN001
        task = self._loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)
        return task

    async def _start(self, host: str, port: int) -> None:
        if self._send_t is not None:
            router = self._zctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(f"tcp://{host}:{port}")
            self._router = router
            self.side_channel_address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            await self._send_t.start(host)
            self._spawn(self._serve())
        self._spawn(self._ticker())

    async def _shutdown(self) -> None:
        for peer in list(self._peers.values()):
            await self._drop_peer(peer, LoadFailure(FailureReason.CLOSED, "connector closed"))
        for task in list(self._tasks):
            task.cancel()
        if self._send_t is not None:
            await self._send_t.close()
        if self._recv_t is not None:
            await self._recv_t.close()
        if self._router is not None:
            self._router.close(linger=0)

    async def _ticker(self) -> None:
        interval = min(0.25, self._lease_seconds / 5)
        while True:
            await asyncio.sleep(interval)
            try:
                self._tick()
            except Exception:
                log.exception("kv connector tick failed")

    def _tick(self) -> None:
        now = self._clock()
        with self._lock:
            self._apply_released(self._leases.expire(now))
        for peer in list(self._peers.values()):
            due = [
                rid
                for rid, load in peer.loads.items()
                if now - load.last_renew >= load.params.lease_seconds / 3
            ]
            if due and peer.engine_id is not None:
                for rid in due:
                    peer.loads[rid].last_renew = now
                self._send_peer(peer, p.Renew(peer.engine_id, tuple(due)))

    def _count_failure(self, reason: FailureReason) -> None:
        if self._metrics is not None:
            self._metrics.add_failure(reason.value)

    # ----- prefill side ----------------------------------------------------------------------

    def _apply_released(self, released: list[Released]) -> None:
        """Caller holds the lock. Hands ids to the engine and tells the puller, if any."""
        for r in released:
            pub = self._published.pop(r.request_id, None)
            self._released.append(r.request_id)
            if r.reason is not None:
                log.info("kv: released %s (%s)", r.request_id, r.reason.value)
                self._count_failure(r.reason)
            if (
                pub is not None
                and pub.peer is not None
                and r.reason in (FailureReason.ABORTED, FailureReason.LEASE_EXPIRED)
            ):
                msg = p.Aborted(self.engine_id, r.request_id, r.reason.value)
                self._loop.call_soon_threadsafe(self._reply, pub.peer, msg)

    def _reply(self, ident: bytes, msg: p.Message) -> None:
        if self._router is None or self._router.closed:
            return
        fut = self._router.send_multipart([ident, p.encode_message(msg)])
        fut.add_done_callback(_log_send_error)

    async def _serve(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            try:
                self._on_side_frames(frames)
            except Exception:  # never let one peer's input stop the side channel
                log.exception("kv side channel: handler failed")

    def _reject(
        self,
        ident: bytes,
        code: str,
        message: str,
        request_id: str | None = None,
        xfer_id: int | None = None,
    ) -> None:
        log.warning("kv side channel: rejected message: %s: %s", code, message)
        self._count_failure(
            FailureReason.BAD_MESSAGE
            if code
            in ("malformed", "oversized", "version", "unknown_type", "invalid_field", "bad_framing")
            else FailureReason.INVALID_REQUEST
        )
        self._reply(ident, p.Error(code, message[: p.MAX_TEXT_LEN], request_id, xfer_id))

    def _on_side_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("kv side channel: dropped a %d-frame message", len(frames))
            self._count_failure(FailureReason.BAD_MESSAGE)
            return
        ident, data = frames
        try:
            msg = p.decode_message(data)
        except p.ProtocolError as exc:
            self._reject(ident, exc.code, exc.message)
            return
        log.debug("kv side channel: %s from %s", type(msg).__name__, ident.hex()[:8])
        match msg:
            case p.Hello():
                self._on_hello(ident, msg)
            case p.Pull():
                self._on_pull(ident, msg)
            case p.Renew():
                self._on_renew(ident, msg)
            case p.Release():
                self._on_release(ident, msg)
            case _:
                self._reject(ident, "unexpected", f"{type(msg).__name__} is not for prefill")

    def _on_hello(self, ident: bytes, msg: p.Hello) -> None:
        assert self._send_t is not None
        if len(ident) != TOKEN_BYTES:
            self._reject(ident, "bad_framing", "routing id must be a 16-byte token")
            return
        if msg.transport != self._send_t.name:
            self._reject(
                ident,
                "transport_mismatch",
                f"prefill uses {self._send_t.name}, decode asked for {msg.transport}",
            )
            return
        mismatch = layout_mismatch(self.layout, msg.layout)
        if mismatch is not None:
            self._reject(ident, "layout_mismatch", mismatch)
            return
        self._hello_peers.add(ident)
        self._reply(
            ident,
            p.HelloOk(self.engine_id, self._send_t.name, self.layout, self._send_t.data_address),
        )

    def _on_pull(self, ident: bytes, msg: p.Pull) -> None:
        if ident not in self._hello_peers:
            self._reject(ident, "no_handshake", "PULL before HELLO", msg.request_id, msg.xfer_id)
            return
        if msg.engine_id != self.engine_id:
            self._reject(
                ident,
                "stale_engine",
                f"engine {msg.engine_id} is not this engine "
                f"({self.engine_id}); the prefill worker restarted",
                msg.request_id,
                msg.xfer_id,
            )
            return
        with self._lock:
            pub = self._published.get(msg.request_id)
            problem = None
            if pub is None or not self._leases.is_active(msg.request_id):
                code, problem = "unknown_request", f"request {msg.request_id!r} is not published"
            else:
                code = "invalid_request"
                problem = p.check_pull_segments(msg.segments, pub.block_ids, self.layout.num_blocks)
            if problem is None:
                assert pub is not None
                self._leases.begin_transfer(msg.request_id, self._clock())
                pub.peer = ident
        if problem is not None:
            self._reject(ident, code, problem, msg.request_id, msg.xfer_id)
            return
        self._reply(ident, p.PullAccepted(msg.xfer_id))
        self._spawn(self._serve_pull(ident, msg))

    async def _serve_pull(self, ident: bytes, msg: p.Pull) -> None:
        assert self._send_t is not None
        views = [block_bytes_view(self._kv, start, n) for start, n in msg.segments]
        reason = None
        try:
            await self._send_t.send(ident, msg.xfer_id, views, self._transfer_timeout)
            if self._metrics is not None:
                self._metrics.add_bytes("send", self._send_t.name, sum(v.numel() for v in views))
        except TransferError as exc:
            reason = str(exc)
            log.warning("kv: sending %s failed: %s", msg.request_id, exc)
            self._count_failure(FailureReason.TRANSFER_ERROR)
        finally:
            with self._lock:
                self._apply_released(self._leases.end_transfer(msg.request_id, self._clock()))
        self._reply(ident, p.PullDone(msg.xfer_id, reason is None, reason))

    def _on_renew(self, ident: bytes, msg: p.Renew) -> None:
        gone = []
        with self._lock:
            for rid in msg.request_ids:
                if msg.engine_id != self.engine_id or not self._leases.renew(rid, self._clock()):
                    gone.append(rid)
        for rid in gone:
            why = "unknown request" if msg.engine_id == self.engine_id else "stale engine id"
            self._reply(ident, p.Aborted(msg.engine_id, rid, why))

    def _on_release(self, ident: bytes, msg: p.Release) -> None:
        if msg.engine_id != self.engine_id:
            self._reject(
                ident, "stale_engine", f"engine {msg.engine_id} is not this engine", msg.request_id
            )
            return
        with self._lock:
            self._apply_released(
                self._leases.release(msg.request_id, _RELEASE_REASON[msg.kind], self._clock())
            )

    # ----- decode side -----------------------------------------------------------------------

    def _finish_load(self, request_id: str, failure: LoadFailure | None) -> None:
        """Caller holds the lock."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return
        if failure is None:
            self._finished.append(LoadResult(request_id, True))
            if self._metrics is not None and self._recv_t is not None:
                self._metrics.observe_seconds(self._recv_t.name, time.monotonic() - load.started)
        else:
            log.warning("kv: load %s failed: %s", request_id, failure)
            self._count_failure(failure.reason)
            self._finished.append(LoadResult(request_id, False, failure.reason, failure.detail))

    def _interrupt(self, load: _Load, failure: LoadFailure) -> None:
        load.aborted = load.aborted or failure.reason == FailureReason.ABORTED
        if load.interrupt is not None and not load.interrupt.done():
            load.interrupt.set_result(failure)

    async def _run_load(self, load: _Load) -> None:
        load.interrupt = self._loop.create_future()
        if load.aborted:  # abort() raced with start
            load.interrupt.set_result(LoadFailure(FailureReason.ABORTED, "aborted by decode"))
        peer: _Peer | None = None
        kind = p.ReleaseKind.FAILED
        try:
            peer = await self._until_interrupted(load, self._peer_for(load.params))
            if load.interrupt.done():
                raise load.interrupt.result()
            peer.loads[load.params.remote_request_id] = load
            load.last_renew = self._clock()
            if load.runs:
                await self._pull(peer, load)
            if load.interrupt.done():
                raise load.interrupt.result()
            kind = p.ReleaseKind.DONE
            failure = None
        except LoadFailure as exc:
            failure = exc
            if exc.reason == FailureReason.ABORTED:
                kind = p.ReleaseKind.ABORTED
        except Exception as exc:  # a bug must still end the load, never leave it hanging
            log.exception("kv: load %s crashed", load.request_id)
            failure = LoadFailure(FailureReason.TRANSFER_ERROR, repr(exc))
        if peer is not None:
            peer.loads.pop(load.params.remote_request_id, None)
            if peer.engine_id is not None and not peer.closed:
                self._send_peer(
                    peer, p.Release(load.params.engine_id, load.params.remote_request_id, kind)
                )
        elif kind == p.ReleaseKind.ABORTED:
            # Aborted before the handshake finished: still free prefill's blocks now rather
            # than at lease expiry.
            self._spawn(self._release_when_connected(load.params, kind))
        with self._lock:
            self._finish_load(load.request_id, failure)

    async def _release_when_connected(
        self, params: KVTransferParams, kind: p.ReleaseKind
    ) -> None:
        try:
            peer = await self._peer_for(params)
        except LoadFailure as exc:
            log.info("kv: could not tell %s to release: %s", params.side_channel, exc)
            return
        self._send_peer(peer, p.Release(params.engine_id, params.remote_request_id, kind))

    async def _until_interrupted(self, load: _Load, coro):  # noqa: ANN001, ANN202
        assert load.interrupt is not None
        task = asyncio.ensure_future(coro)
        await asyncio.wait({task, load.interrupt}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise load.interrupt.result()
        return task.result()

    async def _pull(self, peer: _Peer, load: _Load) -> None:
        assert self._recv_t is not None and load.interrupt is not None
        recv = self._recv_t
        xfer = recv.new_xfer_id()
        views = [block_bytes_view(self._kv, loc, n) for _, loc, n in load.runs]
        accepted: asyncio.Future[p.Message] = self._loop.create_future()
        done: asyncio.Future[p.Message] = self._loop.create_future()
        peer.waiters[xfer] = (accepted, done)
        try:
            recv.expect(peer.token, xfer, views)
        except TransferError as exc:
            raise LoadFailure(FailureReason.PEER_DISCONNECTED, str(exc)) from None
        try:
            pull = p.Pull(
                load.params.engine_id,
                load.params.remote_request_id,
                xfer,
                tuple((r, n) for r, _, n in load.runs),
            )
            self._send_peer(peer, pull)
            # Once prefill may be sending, a UCX load must see the transfer through (its
            # sends would otherwise stall on our side); TCP can drop the data on arrival.
            answer = self._until_interrupted(load, accepted) if recv.cancel_safe else accepted
            try:
                reply = await asyncio.wait_for(answer, self._transfer_timeout)
            except TimeoutError:
                raise LoadFailure(FailureReason.TIMEOUT, "prefill did not answer PULL") from None
            _raise_for_reply(reply)
            load.receiving = True
            waiting = asyncio.ensure_future(recv.wait(xfer, self._transfer_timeout))
            if recv.cancel_safe:
                await asyncio.wait({waiting, load.interrupt}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    waiting.cancel()
                    with contextlib.suppress(BaseException):
                        await waiting
                    raise load.interrupt.result()
            try:
                await waiting
            except TransferError as exc:
                raise LoadFailure(FailureReason.TRANSFER_ERROR, str(exc)) from None
            try:
                reply = await asyncio.wait_for(asyncio.shield(done), self._transfer_timeout)
            except TimeoutError:
                raise LoadFailure(FailureReason.TIMEOUT, "no PULL_DONE from prefill") from None
            _raise_for_reply(reply)
            if self._metrics is not None:
                self._metrics.add_bytes("recv", recv.name, sum(v.numel() for v in views))
        finally:
            peer.waiters.pop(xfer, None)
            recv.forget(xfer)

    async def _peer_for(self, params: KVTransferParams) -> _Peer:
        peer = self._peers.get(params.side_channel)
        if peer is not None and peer.ready.done() and peer.engine_id != params.engine_id:
            # The address now serves another engine (a restart) or the params are stale:
            # handshake again rather than trust what we learned from a predecessor.
            await self._drop_peer(peer, LoadFailure(FailureReason.STALE_ENGINE, "engine changed"))
            peer = None
        if peer is None:
            peer = self._connect(params.side_channel)
        try:
            hello = await asyncio.wait_for(asyncio.shield(peer.ready), 2 * self._handshake_timeout)
        except TimeoutError:
            await self._drop_peer(peer, LoadFailure(FailureReason.HANDSHAKE, "timed out"))
            raise LoadFailure(
                FailureReason.HANDSHAKE, f"no handshake answer from {params.side_channel}"
            ) from None
        if hello.engine_id != params.engine_id:
            raise LoadFailure(
                FailureReason.STALE_ENGINE,
                f"{params.side_channel} now serves engine {hello.engine_id}, not "
                f"{params.engine_id} (prefill restarted; its blocks are gone)",
            )
        return peer

    def _connect(self, address: str) -> _Peer:
        assert self._recv_t is not None
        token = uuid.uuid4().bytes
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, token)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        peer = _Peer(address, token, sock, self._loop.create_future(), self._loop.create_future())
        self._peers[address] = peer
        peer.tasks.append(self._spawn(self._handshake(peer)))
        peer.tasks.append(self._spawn(self._read_peer(peer)))
        peer.tasks.append(self._spawn(self._watch_peer(peer, monitor)))
        return peer

    async def _handshake(self, peer: _Peer) -> None:
        assert self._recv_t is not None
        self._send_peer(peer, p.Hello(self.engine_id, self._recv_t.name, self.layout))
        try:
            reply = await asyncio.shield(peer.hello)
            await self._recv_t.connect(reply.data_address, peer.token, self._handshake_timeout)
        except (LoadFailure, TransferError) as exc:
            failure = (
                exc
                if isinstance(exc, LoadFailure)
                else LoadFailure(FailureReason.HANDSHAKE, str(exc))
            )
            await self._drop_peer(peer, failure)
            return
        peer.engine_id = reply.engine_id
        self._set_future(peer.ready, reply)

    @staticmethod
    def _set_future(fut: asyncio.Future[p.HelloOk], value: p.HelloOk | LoadFailure) -> None:
        if fut.done():
            return
        if isinstance(value, LoadFailure):
            fut.set_exception(value)
            fut.exception()  # mark retrieved: whoever awaits re-raises it
        else:
            fut.set_result(value)

    async def _read_peer(self, peer: _Peer) -> None:
        while True:
            frames = await peer.sock.recv_multipart()
            try:
                self._on_peer_frames(peer, frames)
            except Exception:
                log.exception("kv side channel: peer handler failed")

    def _on_peer_frames(self, peer: _Peer, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("kv side channel: dropped a %d-frame reply", len(frames))
            self._count_failure(FailureReason.BAD_MESSAGE)
            return
        try:
            msg = p.decode_message(frames[0])
        except p.ProtocolError as exc:
            log.warning("kv side channel: bad reply from %s: %s", peer.address, exc)
            self._count_failure(FailureReason.BAD_MESSAGE)
            return
        log.debug("kv side channel: %s from %s", type(msg).__name__, peer.address)
        match msg:
            case p.HelloOk():
                problem = layout_mismatch(self.layout, msg.layout)
                if problem is not None:
                    self._set_future(
                        peer.hello, LoadFailure(FailureReason.LAYOUT_MISMATCH, problem)
                    )
                elif self._recv_t is None or msg.transport != self._recv_t.name:
                    self._set_future(
                        peer.hello,
                        LoadFailure(FailureReason.HANDSHAKE, f"prefill uses {msg.transport}"),
                    )
                else:
                    self._set_future(peer.hello, msg)
            case p.PullAccepted() | p.PullDone() | p.Error() if msg.xfer_id is not None:
                futures = peer.waiters.get(msg.xfer_id, ())
                if isinstance(msg, p.PullDone):
                    futures = futures[1:]
                for fut in futures:
                    if not fut.done():
                        fut.set_result(msg)
                        break
            case p.Error():
                log.warning("kv side channel: %s says %s: %s", peer.address, msg.code, msg.message)
                if not peer.hello.done():
                    reason = (
                        FailureReason.LAYOUT_MISMATCH
                        if msg.code == "layout_mismatch"
                        else FailureReason.HANDSHAKE
                    )
                    self._set_future(peer.hello, LoadFailure(reason, msg.message))
            case p.Aborted():
                load = peer.loads.get(msg.request_id)
                if load is not None and msg.engine_id == load.params.engine_id:
                    self._interrupt(
                        load,
                        LoadFailure(
                            FailureReason.PEER_ABORTED, f"prefill released it: {msg.reason}"
                        ),
                    )
            case _:
                log.warning("kv side channel: unexpected %s from prefill", type(msg).__name__)

    async def _watch_peer(self, peer: _Peer, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    break
        finally:
            monitor.close(linger=0)
        await self._drop_peer(
            peer,
            LoadFailure(
                FailureReason.PEER_DISCONNECTED,
                f"side channel to {peer.address} disconnected (prefill died?)",
            ),
        )

    async def _drop_peer(self, peer: _Peer, failure: LoadFailure) -> None:
        if peer.closed:
            return
        peer.closed = True
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        self._set_future(peer.hello, failure)
        self._set_future(peer.ready, failure)
        for load in list(peer.loads.values()):
            self._interrupt(load, failure)
        for futures in peer.waiters.values():
            for fut in futures:
                if not fut.done():
                    fut.set_result(p.Error(failure.reason.value, failure.detail, None, None))
        current = asyncio.current_task()
        for task in peer.tasks:
            if task is not current:
                task.cancel()
        if self._recv_t is not None:
            with contextlib.suppress(TransferError):
                await self._recv_t.disconnect(peer.token)
        peer.sock.close(linger=0)

    def _send_peer(self, peer: _Peer, msg: p.Message) -> None:
        if peer.closed:
            return
        fut = peer.sock.send(p.encode_message(msg))
        fut.add_done_callback(_log_send_error)


def _raise_for_reply(reply: p.Message) -> None:
    match reply:
        case p.PullAccepted():
            return
        case p.PullDone(ok=True):
            return
        case p.PullDone():
            raise LoadFailure(FailureReason.TRANSFER_ERROR, f"prefill send failed: {reply.reason}")
        case p.Error():
            try:
                reason = FailureReason(reply.code)
            except ValueError:
                reason = FailureReason.INVALID_REQUEST
            raise LoadFailure(reason, f"prefill refused: {reply.code}: {reply.message}")
    raise LoadFailure(FailureReason.BAD_MESSAGE, f"unexpected reply {type(reply).__name__}")


def _log_send_error(fut: asyncio.Future) -> None:  # type: ignore[type-arg]
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("kv side channel: send failed: %s", fut.exception())
