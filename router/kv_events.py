"""KV-event subscription: one ZMQ SUB task per registered worker feeding the PrefixIndex.

The app starts a subscription when a worker registers and stops it when the worker leaves; the
``KvEventSubscriber`` owns the ZMQ context and every socket. Each task first loads a snapshot
(``/v1/internal/kv_blocks``, whose ``seq`` is the number of the next message the worker will
publish), then applies events in sequence order; a gap, a foreign engine id or a malformed message
triggers another snapshot. With a cluster token, each subscription logs in with ZMQ's PLAIN
mechanism (password: the token), which the worker's publisher checks. Messages are msgpack data
only, size-limited; the codec is the engine's (``tandem.engine.kv_events``), shared with the
workers' publisher."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.kv_events import (
    MAX_MESSAGE_BYTES,
    PLAIN_USERNAME,
    TOPIC,
    MalformedEvent,
    decode_batch,
)
from tandem.router.prefix_index import ApplyResult, PrefixIndex
from tandem.router.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class KvEventSubscriber:
    """Owns the ZMQ context and one subscription task per worker."""

    def __init__(
        self,
        index: PrefixIndex,
        client: WorkerClient,
        on_event: Callable[[str, ApplyResult], None] | None = None,
        resync_backoff_s: float = 0.5,
        token: ClusterToken | None = None,
        connect_wait_s: float = 5.0,
    ) -> None:
        self._token = token
        self._connect_wait_s = connect_wait_s
        self._index = index
        self._client = client
        self._on_event = on_event
        self._backoff = resync_backoff_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Cancelled by stop() and not yet finished: each still holds a socket until its
        # ``finally`` runs, which close() must wait for before it ends the context.
        self._stopping: set[asyncio.Task[None]] = set()

    def start(self, engine_id: str, endpoint: str, worker_url: str) -> None:
        self.stop(engine_id)
        self._tasks[engine_id] = asyncio.create_task(
            self._run(engine_id, endpoint, worker_url), name=f"kv-events-{engine_id}"
        )

    def stop(self, engine_id: str) -> None:
        task = self._tasks.pop(engine_id, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        """Stop every subscription, wait until each has closed its socket, then end the context.
        Waiting matters: ``Context.term`` blocks the thread (the event loop) until every socket is
        closed, and a task cancelled but not yet run closes its socket only on the loop, so a
        worker that left just before shutdown would hang it."""
        tasks = [*self._tasks.values(), *self._stopping]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Every socket is closed by now; linger 0 all the same, so nothing can block here.
        self._ctx.destroy(linger=0)

    async def _resync(self, engine_id: str, worker_url: str) -> None:
        """Load a snapshot, retrying with backoff until it is consistent or the task is stopped."""
        while True:
            try:
                snap = await self._client.kv_blocks(worker_url)
                if self._index.load_snapshot(
                    engine_id, snap.engine_id, snap.seq, snap.block_hashes, snap.host_block_hashes
                ):
                    return
                log.warning("kv snapshot of %s came from engine %s", engine_id, snap.engine_id)
            except WorkerUnavailable as exc:
                log.warning("kv resync of %s failed: %s", engine_id, exc)
            await asyncio.sleep(self._backoff)

    async def _connected(self, sock: zmq.asyncio.Socket, engine_id: str, endpoint: str) -> None:
        """Connect and wait (bounded) for the ZMTP handshake, so the snapshot that follows is
        not older than the first event we can receive; a refused token is logged, once."""
        monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        try:
            sock.connect(endpoint)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._connect_wait_s
            warned = False
            while (left := deadline - loop.time()) > 0:
                try:
                    frames = await asyncio.wait_for(monitor.recv_multipart(), left)
                except TimeoutError:
                    break
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not warned:
                    warned = True
                    log.error(
                        "kv events of %s (%s) refused our cluster token; retrying",
                        engine_id, endpoint,
                    )  # fmt: skip
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    async def _run(self, engine_id: str, endpoint: str, worker_url: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if self._token is not None:
            # The publisher's ZAP handler checks the password against its accepted tokens.
            sock.plain_username = PLAIN_USERNAME
            sock.plain_password = self._token.current.encode()
        try:
            await self._connected(sock, engine_id, endpoint)
            await self._resync(engine_id, worker_url)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 2 or frames[0] != TOPIC:
                    self._index.invalidate(engine_id)
                    result = ApplyResult.NEEDS_RESYNC
                else:
                    try:
                        result = self._index.apply(engine_id, decode_batch(frames[1]))
                    except MalformedEvent as exc:
                        log.warning("malformed kv event from %s: %s", engine_id, exc)
                        self._index.invalidate(engine_id)
                        result = ApplyResult.NEEDS_RESYNC
                if self._on_event is not None:
                    self._on_event(engine_id, result)
                if result is ApplyResult.NEEDS_RESYNC:
                    await self._resync(engine_id, worker_url)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            log.error("kv event subscription to %s (%s) failed: %s", engine_id, endpoint, exc)
        finally:
            sock.close(linger=0)
