"""Decode side of the connector: the lifecycle of each load (hold, pull, finish, release).

A load first gets the ``PeerLink`` to its prefill engine (one per engine: handshake with layout
and transport checked on both ends, data channel connected; see peer_link.py), then sends PULL,
posts its receives only after PULL_ACCEPTED (so no receive is left posted for data nobody
sends), and succeeds only when every byte arrived and, where the transport cannot tell by
itself, prefill reported PULL_DONE. It then tells prefill to release. Any failure ends the load
with a reason and still releases on prefill (best effort: the lease covers a lost message).
Pending loads renew their leases every third of the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from tandem.engine.kv_connector import FailureReason, KVTransferParams, LoadResult
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import holder_proof, pull_proof
from tandem.kvtransfer.context import ConnectorContext, LoadFailure
from tandem.kvtransfer.peer_link import Held, PeerLink
from tandem.kvtransfer.transport import RecvTransport, TransferError, block_bytes_view

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    request_id: str
    params: KVTransferParams
    runs: list[tuple[int, int, int]]
    interrupt_future: asyncio.Future[LoadFailure] | None = None
    receiving: bool = False
    aborted: bool = False
    last_renew: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def interrupt(self, failure: LoadFailure) -> None:
        """Stop the load with ``failure`` (loop thread); the first interruption wins."""
        self.aborted = self.aborted or failure.reason == FailureReason.ABORTED
        if self.interrupt_future is not None and not self.interrupt_future.done():
            self.interrupt_future.set_result(failure)


class DecodeSide:
    """Owned by ZmqKVConnector. Engine-thread methods: start_load, take_finished_loads, abort.
    Loop methods: tick, close. ``_loads``/``_finished`` are guarded by ``ctx.lock``; peers live
    on the loop only."""

    def __init__(self, ctx: ConnectorContext, recv: RecvTransport) -> None:
        self._ctx = ctx
        self._recv = recv
        self._loads: dict[str, _Load] = {}
        self._held: dict[str, KVTransferParams] = {}  # by local request id, under ctx.lock
        self._finished: list[LoadResult] = []
        self._peers: dict[str, PeerLink] = {}
        self._closed = False

    def hold(self, request_id: str, params: KVTransferParams) -> None:
        with self._ctx.lock:
            if self._closed:
                raise RuntimeError("connector is closed")
            if request_id in self._loads or request_id in self._held:
                raise ValueError(f"request {request_id!r} is already held or loading")
            self._held[request_id] = params
        self._ctx.loop.call_soon_threadsafe(self._ctx.spawn, self._hold(request_id, params))

    async def _hold(self, request_id: str, params: KVTransferParams) -> None:
        try:
            peer = await self._peer_for(params)
        except LoadFailure as exc:  # start_load will report it; nothing to renew meanwhile
            log.info("kv: cannot hold %s: %s", request_id, exc)
            return
        with self._ctx.lock:
            still_held = self._held.get(request_id) is params
        if still_held:
            # Renewed on the next tick: the lease becomes this decode's at once (a retry after
            # another decode failed must own it before that one's late release arrives).
            peer.held[params.remote_request_id] = Held(params, float("-inf"))

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        num_blocks = self._ctx.layout.num_blocks
        published = set(params.block_ids)
        if any(b not in published for b in remote_block_ids):
            raise ValueError("remote_block_ids must be a subset of params.block_ids")
        if any(type(b) is not int or not 0 <= b < num_blocks for b in local_block_ids):
            raise ValueError(f"local block ids out of range [0, {num_blocks})")
        if len(set(local_block_ids)) != len(local_block_ids) or len(set(remote_block_ids)) != len(
            remote_block_ids
        ):
            raise ValueError("block ids must not repeat")
        runs = p.plan_segments(remote_block_ids, local_block_ids)  # ValueError on length
        load = _Load(request_id, params, runs)
        with self._ctx.lock:
            if self._closed:
                raise RuntimeError("connector is closed")
            if request_id in self._loads:
                raise ValueError(f"request {request_id!r} already has a load in progress")
            self._held.pop(request_id, None)
            self._loads[request_id] = load
        self._ctx.loop.call_soon_threadsafe(self._ctx.spawn, self._run_load(load))

    def take_finished_loads(self) -> list[LoadResult]:
        with self._ctx.lock:
            out, self._finished = self._finished, []
        return out

    def abort(self, request_id: str) -> None:
        with self._ctx.lock:
            load = self._loads.get(request_id)
            held = self._held.pop(request_id, None)
        if held is not None:
            self._ctx.loop.call_soon_threadsafe(self._unhold, held)
        if load is not None:
            failure = LoadFailure(FailureReason.ABORTED, "aborted by decode")
            self._ctx.loop.call_soon_threadsafe(load.interrupt, failure)

    def _unhold(self, params: KVTransferParams) -> None:
        peer = self._peers.get(params.side_channel)
        if peer is not None:
            peer.held.pop(params.remote_request_id, None)
        self._ctx.spawn(self._release_when_connected(params, p.ReleaseKind.ABORTED))

    def tick(self) -> None:
        """Renew, every third of a lease, what pending loads and held requests still need."""
        now = self._ctx.clock()
        for peer in list(self._peers.values()):
            entries: list[tuple[str, _Load | Held]] = [*peer.loads.items(), *peer.held.items()]
            due = [
                (rid, entry)
                for rid, entry in entries
                if now - entry.last_renew >= entry.params.lease_seconds / 3
            ]
            if due and peer.engine_id is not None:
                proofs: dict[str, str] = {}
                for rid, entry in due:
                    entry.last_renew = now
                    proofs[rid] = _holder(entry.params)
                ids = tuple(proofs)
                for i in range(0, len(ids), p.MAX_RENEW_IDS):
                    batch = ids[i : i + p.MAX_RENEW_IDS]
                    peer.send(p.Renew(peer.engine_id, batch, tuple(proofs[r] for r in batch)))

    async def close(self) -> None:
        with self._ctx.lock:
            self._closed = True
        for peer in list(self._peers.values()):
            await peer.close(LoadFailure(FailureReason.CLOSED, "connector closed"))
        await self._recv.close()

    def fail_remaining(self) -> None:
        """After the loop stopped: every load still open ends as CLOSED."""
        with self._ctx.lock:
            self._closed = True
            for rid in list(self._loads):
                self._finish_load(rid, LoadFailure(FailureReason.CLOSED, "connector closed"))

    def _finish_load(self, request_id: str, failure: LoadFailure | None) -> None:
        """Caller holds the lock."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return
        if failure is None:
            self._finished.append(LoadResult(request_id, True))
            if self._ctx.metrics is not None and self._recv is not None:
                self._ctx.metrics.observe_seconds(self._recv.name, time.monotonic() - load.started)
        else:
            log.warning("kv: load %s failed: %s", request_id, failure)
            self._ctx.count_failure(failure.reason)
            self._finished.append(LoadResult(request_id, False, failure.reason, failure.detail))

    async def _run_load(self, load: _Load) -> None:
        load.interrupt_future = self._ctx.loop.create_future()
        if load.aborted:  # abort() raced with start
            load.interrupt_future.set_result(
                LoadFailure(FailureReason.ABORTED, "aborted by decode")
            )
        peer: PeerLink | None = None
        kind = p.ReleaseKind.FAILED
        try:
            peer = self._ready_peer(load.params)
            if peer is None:
                peer = await self._until_interrupted(load, self._peer_for(load.params))
            if load.interrupt_future.done():
                raise load.interrupt_future.result()
            peer.held.pop(load.params.remote_request_id, None)
            peer.loads[load.params.remote_request_id] = load
            load.last_renew = self._ctx.clock()
            if load.runs:
                await self._pull(peer, load)
            if load.interrupt_future.done():
                raise load.interrupt_future.result()
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
                peer.send(_release(load.params, kind))
            if (
                failure is not None
                and failure.reason == FailureReason.TRANSFER_ERROR
                and not self._recv.cancel_safe
                and not peer.closed
            ):
                # A failed UCX receive means the endpoint is gone (the transport dropped it):
                # retire the link, so the next load handshakes and connects afresh instead of
                # failing on a dead endpoint.
                self._forget_peer(peer)
                self._ctx.spawn(_retire(peer, failure))
        elif kind == p.ReleaseKind.ABORTED:
            # Aborted before the handshake finished: still free prefill's blocks now rather
            # than at lease expiry.
            self._ctx.spawn(self._release_when_connected(load.params, kind))
        with self._ctx.lock:
            self._finish_load(load.request_id, failure)
        self._ctx.wake()

    async def _release_when_connected(self, params: KVTransferParams, kind: p.ReleaseKind) -> None:
        try:
            peer = await self._peer_for(params)
        except LoadFailure as exc:
            log.info("kv: could not tell %s to release: %s", params.side_channel, exc)
            return
        peer.send(_release(params, kind))

    async def _until_interrupted(self, load: _Load, coro):  # noqa: ANN001, ANN202
        assert load.interrupt_future is not None
        task = asyncio.ensure_future(coro)
        await asyncio.wait({task, load.interrupt_future}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise load.interrupt_future.result()
        return task.result()

    async def _pull(self, peer: PeerLink, load: _Load) -> None:
        assert self._recv is not None and load.interrupt_future is not None
        recv = self._recv
        xfer = recv.new_xfer_id()
        views = [block_bytes_view(self._ctx.kv, loc, n) for _, loc, n in load.runs]
        accepted: asyncio.Future[p.Message] = self._ctx.loop.create_future()
        done: asyncio.Future[p.Message] = self._ctx.loop.create_future()
        peer.waiters[xfer] = (accepted, done)
        try:
            recv.expect(peer.token, xfer, views, load.params.transfer_secret)
        except TransferError as exc:
            raise LoadFailure(FailureReason.PEER_DISCONNECTED, str(exc)) from None
        try:
            segments = tuple((r, n) for r, _, n in load.runs)
            params = load.params
            pull = p.Pull(
                params.engine_id,
                params.remote_request_id,
                xfer,
                segments,
                pull_proof(
                    params.transfer_secret, params.engine_id, params.remote_request_id, xfer,
                    segments,
                ),
            )  # fmt: skip
            peer.send(pull)
            # Once prefill may be sending, a UCX load must see the transfer through (its
            # sends would otherwise stall on our side); TCP can drop the data on arrival.
            answer = self._until_interrupted(load, accepted) if recv.cancel_safe else accepted
            try:
                reply = await asyncio.wait_for(answer, self._ctx.transfer_timeout)
            except TimeoutError:
                raise LoadFailure(FailureReason.TIMEOUT, "prefill did not answer PULL") from None
            _raise_for_reply(reply)
            load.receiving = True
            waiting = asyncio.ensure_future(recv.wait(xfer, self._ctx.transfer_timeout))
            if recv.cancel_safe:
                await asyncio.wait(
                    {waiting, load.interrupt_future}, return_when=asyncio.FIRST_COMPLETED
                )
                if not waiting.done():
                    waiting.cancel()
                    with contextlib.suppress(BaseException):
                        await waiting
                    raise load.interrupt_future.result()
            try:
                await waiting
            except TransferError as exc:
                raise LoadFailure(exc.reason, str(exc)) from None
            if not recv.self_delimiting:
                try:
                    reply = await asyncio.wait_for(asyncio.shield(done), self._ctx.transfer_timeout)
                except TimeoutError:
                    raise LoadFailure(FailureReason.TIMEOUT, "no PULL_DONE from prefill") from None
                _raise_for_reply(reply)
            if self._ctx.metrics is not None:
                self._ctx.metrics.add_bytes("recv", recv.name, sum(v.numel() for v in views))
        finally:
            peer.waiters.pop(xfer, None)
            recv.forget(xfer)

    def _ready_peer(self, params: KVTransferParams) -> PeerLink | None:
        """The link to ``params``' engine if it is open and its handshake is done, else None.

        The common case once a prefill engine is known: the load sends its PULL in the same
        loop turn, where awaiting ``_peer_for`` under ``_until_interrupted`` costs three more
        (a task, a timed wait on a done future, the wait's wake-up) on the hand-off's path.
        """
        peer = self._peers.get(params.side_channel)
        if peer is None or peer.closed or not peer.ready.done() or peer.ready.cancelled():
            return None
        if peer.ready.exception() is not None or peer.engine_id != params.engine_id:
            return None  # _peer_for reports the failure or handshakes afresh
        return peer

    async def _peer_for(self, params: KVTransferParams) -> PeerLink:
        ready = self._ready_peer(params)
        if ready is not None:  # a hold or release on a known link: no timed wait on a done one
            return ready
        peer = self._peers.get(params.side_channel)
        if peer is not None and peer.ready.done() and peer.engine_id != params.engine_id:
            # The address now serves another engine (a restart) or the params are stale:
            # handshake again rather than trust what we learned from a predecessor.
            await peer.close(LoadFailure(FailureReason.STALE_ENGINE, "engine changed"))
            peer = None
        if peer is None:
            peer = self._open_peer(params.side_channel)
        try:
            hello = await asyncio.wait_for(
                asyncio.shield(peer.ready), 2 * self._ctx.handshake_timeout
            )
        except TimeoutError:
            await peer.close(LoadFailure(FailureReason.HANDSHAKE, "timed out"))
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

    def _open_peer(self, address: str) -> PeerLink:
        assert self._recv is not None
        peer = PeerLink.open(self._ctx, self._recv, address, self._forget_peer)
        self._peers[address] = peer
        return peer

    def _forget_peer(self, peer: PeerLink) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]


async def _retire(peer: PeerLink, failure: LoadFailure) -> None:
    """Close a link no new load uses, once the release just queued on it had time to go out."""
    await asyncio.sleep(_RETIRE_GRACE_S)
    await peer.close(failure)


_RETIRE_GRACE_S = 0.5


def _holder(params: KVTransferParams) -> str:
    return holder_proof(params.transfer_secret, params.engine_id, params.remote_request_id)


def _release(params: KVTransferParams, kind: p.ReleaseKind) -> p.Release:
    return p.Release(params.engine_id, params.remote_request_id, kind, _holder(params))


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
