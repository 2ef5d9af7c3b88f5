"""Prefill side of the connector: leases on published blocks and the side-channel server.

Every frame must be sealed with the cluster token (refused unparsed otherwise). Decode's PULL is
validated (engine id, handshake done, known request under an active lease, proof of the
request's transfer secret for exactly this transfer and these blocks, blocks in range and owned
by that request), answered PULL_ACCEPTED, then the segments go out on the data transport (each
TCP message authenticated with the secret), then PULL_DONE. RENEW and RELEASE need the secret's
holder proof too, so a peer that only has the cluster token can neither pin nor free another
decode's blocks. Releases (decode's confirmation or failure, abort on
either side, lease expiry) reach the engine through ``take_released``; while a transfer still
reads the blocks the release waits for it (see ``lease.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.engine.kv_layout import layout_mismatch
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import (
    data_mac,
    holder_proof,
    new_transfer_secret,
    proof_matches,
    pull_proof,
)
from tandem.kvtransfer.context import ConnectorContext, log_send_error
from tandem.kvtransfer.lease import LeaseTable, Released
from tandem.kvtransfer.transport import TOKEN_BYTES, SendTransport, TransferError, block_bytes_view

log = logging.getLogger(__name__)
_MAX_HELLO_PEERS = 4096

_RELEASE_REASON = {
    p.ReleaseKind.DONE: None,
    p.ReleaseKind.FAILED: FailureReason.TRANSFER_ERROR,
    p.ReleaseKind.ABORTED: FailureReason.PEER_ABORTED,
}


@dataclass(slots=True)
class _Published:
    block_ids: frozenset[int]
    secret: str  # the grant's transfer secret (kv_transfer_params.transfer_secret)
    peer: bytes | None = None  # the decode that pulled, told if prefill aborts or expires


class PrefillSide:
    """Owned by ZmqKVConnector. Engine-thread methods: publish, take_released, abort. Loop
    methods: start, tick, close. Shared state is guarded by ``ctx.lock``."""

    def __init__(self, ctx: ConnectorContext, send: SendTransport, lease_seconds: float) -> None:
        self._ctx = ctx
        self._send = send
        self.lease_seconds = lease_seconds
        self.side_channel_address: str | None = None
        self._leases = LeaseTable(stuck_grace=ctx.transfer_timeout + 5.0)
        self._published: dict[str, _Published] = {}
        self._released: list[str] = []
        # decode tokens that completed HELLO, oldest first; bounded because ROUTER sockets never
        # say when a peer left
        self._hello_peers: dict[bytes, None] = {}
        self._router: zmq.asyncio.Socket | None = None

    async def start(self, host: str, port: int, advertise_host: str, data_port: int = 0) -> None:
        router = self._ctx.zctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://{host}:{port}")
        self._router = router
        bound_port = router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        self.side_channel_address = f"tcp://{advertise_host}:{bound_port}"
        await self._send.start(host, advertise_host, data_port)
        self._ctx.spawn(self._serve())

    async def close(self) -> None:
        await self._send.close()
        if self._router is not None:
            self._router.close(linger=0)

    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        num_blocks = self._ctx.layout.num_blocks
        if any(type(b) is not int or not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range [0, {num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block ids must not repeat")
        assert self.side_channel_address is not None
        secret = new_transfer_secret()
        params = KVTransferParams.from_dict(
            {
                "engine_id": self._ctx.engine_id,
                "side_channel": self.side_channel_address,
                "remote_request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
                "first_token_id": first_token_id,
                "lease_seconds": self.lease_seconds,
                "transfer_secret": secret,
            }
        )
        with self._ctx.lock:
            self._leases.add(request_id, self._ctx.clock(), self.lease_seconds)
            self._published[request_id] = _Published(frozenset(block_ids), secret)
        return params

    def take_released(self) -> list[str]:
        with self._ctx.lock:
            self._apply_released(self._leases.expire(self._ctx.clock()))
            out, self._released = self._released, []
        return out

    def abort(self, request_id: str) -> None:
        with self._ctx.lock:
            self._apply_released(
                self._leases.release(request_id, FailureReason.ABORTED, self._ctx.clock())
            )

    def tick(self) -> None:
        with self._ctx.lock:
            self._apply_released(self._leases.expire(self._ctx.clock()))

    def in_flight(self, request_id: str) -> int:
        """Transfers currently reading this request's blocks (for tests and diagnostics)."""
        with self._ctx.lock:
            return self._leases.in_flight(request_id)

    def _apply_released(self, released: list[Released]) -> None:
        """Caller holds the lock. Hands ids to the engine and tells the puller, if any."""
        for r in released:
            pub = self._published.pop(r.request_id, None)
            self._released.append(r.request_id)
            if r.reason is not None:
                log.info("kv: released %s (%s)", r.request_id, r.reason.value)
                self._ctx.count_failure(r.reason)
            if (
                pub is not None
                and pub.peer is not None
                and r.reason in (FailureReason.ABORTED, FailureReason.LEASE_EXPIRED)
            ):
                msg = p.Aborted(self._ctx.engine_id, r.request_id, r.reason.value)
                self._ctx.loop.call_soon_threadsafe(self._reply, pub.peer, msg)
        if released:
            self._ctx.wake()

    def _reply(self, ident: bytes, msg: p.Message) -> None:
        if self._router is None or self._router.closed:
            return
        fut = self._router.send_multipart([ident, p.seal(msg, self._ctx.auth)])
        fut.add_done_callback(log_send_error)

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
        if code == "unauthorized":
            reason = FailureReason.UNAUTHORIZED
        elif code == "incompatible":
            reason = FailureReason.INCOMPATIBLE
        elif code in (
            "malformed", "oversized", "version", "unknown_type", "invalid_field", "bad_framing"
        ):  # fmt: skip
            reason = FailureReason.BAD_MESSAGE
        else:
            reason = FailureReason.INVALID_REQUEST
        self._ctx.count_failure(reason)
        self._reply(ident, p.Error(code, message[: p.MAX_TEXT_LEN], request_id, xfer_id))

    def _on_side_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("kv side channel: dropped a %d-frame message", len(frames))
            self._ctx.count_failure(FailureReason.BAD_MESSAGE)
            return
        ident, data = frames
        try:
            msg = p.unseal(data, self._ctx.auth)
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
        assert self._send is not None
        if len(ident) != TOKEN_BYTES:
            self._reject(ident, "bad_framing", "routing id must be a 16-byte token")
            return
        if msg.transport != self._send.name:
            self._reject(
                ident,
                "transport_mismatch",
                f"prefill uses {self._send.name}, decode asked for {msg.transport}",
            )
            return
        mismatch = layout_mismatch(self._ctx.layout, msg.layout)
        if mismatch is not None:
            self._reject(ident, "layout_mismatch", mismatch)
            return
        if msg.fingerprint != self._ctx.fingerprint:
            # Another model, checkpoint, dtype or version computed that decode's KV: this
            # prefill's blocks would be garbage to it. Refused before any pull.
            self._reject(
                ident,
                "incompatible",
                f"fingerprint mismatch: this prefill is {self._ctx.identity} "
                f"({self._ctx.fingerprint}), the decode is {msg.identity} ({msg.fingerprint})",
            )
            return
        self._hello_peers[ident] = None
        if len(self._hello_peers) > _MAX_HELLO_PEERS:
            del self._hello_peers[next(iter(self._hello_peers))]
        self._reply(
            ident,
            p.HelloOk(
                self._ctx.engine_id,
                self._send.name,
                self._ctx.layout,
                self._send.data_address,
                self._ctx.fingerprint,
                self._ctx.identity,
            ),
        )

    def _on_pull(self, ident: bytes, msg: p.Pull) -> None:
        if ident not in self._hello_peers:
            self._reject(ident, "no_handshake", "PULL before HELLO", msg.request_id, msg.xfer_id)
            return
        if msg.engine_id != self._ctx.engine_id:
            self._reject(
                ident,
                "stale_engine",
                f"engine {msg.engine_id} is not this engine "
                f"({self._ctx.engine_id}); the prefill worker restarted",
                msg.request_id,
                msg.xfer_id,
            )
            return
        with self._ctx.lock:
            pub = self._published.get(msg.request_id)
            problem = None
            if pub is None or not self._leases.is_active(msg.request_id):
                code, problem = "unknown_request", f"request {msg.request_id!r} is not published"
            elif not proof_matches(
                pull_proof(
                    pub.secret, self._ctx.engine_id, msg.request_id, msg.xfer_id, msg.segments
                ),
                msg.proof,
            ):
                code, problem = "unauthorized", "the pull does not prove the transfer's secret"
            else:
                code = "invalid_request"
                problem = p.check_pull_segments(
                    msg.segments, pub.block_ids, self._ctx.layout.num_blocks
                )
            if problem is None:
                assert pub is not None
                self._leases.begin_transfer(msg.request_id, self._ctx.clock(), ident)
                pub.peer = ident
        if problem is not None:
            self._reject(ident, code, problem, msg.request_id, msg.xfer_id)
            return
        self._reply(ident, p.PullAccepted(msg.xfer_id))
        self._ctx.spawn(self._serve_pull(ident, msg, pub.secret))

    async def _serve_pull(self, ident: bytes, msg: p.Pull, secret: str) -> None:
        assert self._send is not None
        views = [block_bytes_view(self._ctx.kv, start, n) for start, n in msg.segments]
        mac = data_mac(secret, msg.xfer_id, [v.numel() for v in views])
        reason = None
        try:
            await self._send.send(ident, msg.xfer_id, views, self._ctx.transfer_timeout, mac)
            if self._ctx.metrics is not None:
                self._ctx.metrics.add_bytes("send", self._send.name, sum(v.numel() for v in views))
        except Exception as exc:  # TransferError, or anything a transport let escape
            reason = str(exc) if isinstance(exc, TransferError) else repr(exc)
            log.warning("kv: sending %s failed: %s", msg.request_id, reason)
            self._ctx.count_failure(FailureReason.TRANSFER_ERROR)
        finally:
            with self._ctx.lock:
                self._apply_released(self._leases.end_transfer(msg.request_id, self._ctx.clock()))
        self._reply(ident, p.PullDone(msg.xfer_id, reason is None, reason))

    def _holds(self, request_id: str, proof: str) -> bool:
        """Caller holds the lock: whether ``proof`` shows the request's transfer secret."""
        pub = self._published.get(request_id)
        return pub is not None and proof_matches(
            holder_proof(pub.secret, self._ctx.engine_id, request_id), proof
        )

    def _on_renew(self, ident: bytes, msg: p.Renew) -> None:
        gone = []
        refused = 0
        with self._ctx.lock:
            for rid, proof in zip(msg.request_ids, msg.proofs, strict=True):
                if msg.engine_id != self._ctx.engine_id:
                    gone.append(rid)
                elif rid in self._published and not self._holds(rid, proof):
                    refused += 1
                    gone.append(rid)
                elif not self._leases.renew(rid, self._ctx.clock(), ident):
                    gone.append(rid)
        for _ in range(refused):
            self._ctx.count_failure(FailureReason.UNAUTHORIZED)
        for rid in gone:
            why = "unknown request" if msg.engine_id == self._ctx.engine_id else "stale engine id"
            self._reply(ident, p.Aborted(msg.engine_id, rid, why))

    def _on_release(self, ident: bytes, msg: p.Release) -> None:
        if msg.engine_id != self._ctx.engine_id:
            self._reject(
                ident, "stale_engine", f"engine {msg.engine_id} is not this engine", msg.request_id
            )
            return
        with self._ctx.lock:
            known = msg.request_id in self._published
            allowed = known and self._holds(msg.request_id, msg.proof)
            if allowed:
                self._apply_released(
                    self._leases.release(
                        msg.request_id, _RELEASE_REASON[msg.kind], self._ctx.clock(), ident
                    )
                )
        if known and not allowed:
            self._reject(
                ident, "unauthorized", "the release does not prove the transfer's secret",
                msg.request_id,
            )  # fmt: skip
