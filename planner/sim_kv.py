"""KV transfers on the virtual clock: a ``KVConnector`` per simulated worker over one fabric.

The real ``PrefillHooks`` and ``DecodeHooks`` drive these connectors exactly as they drive the
ZMQ connector: publish on hand-off, hold while queued, ``start_load`` for the blocks the decode
prefix cache lacks, finished loads applied in ``before_step``, releases freeing the prefill's
pinned blocks. A pull takes the profile's transfer time for its bytes; pulls from one prefill
worker go one after another (its send link is busy), as a prefill's data socket sends them.
Leases never expire here (the decode side renews them while it holds a request).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.kv_connector import FailureReason, KVTransferParams, LoadResult
from tandem.planner.events import EventLoop

SIDE_CHANNEL = "tcp://simulated:1"
LEASE_SECONDS = 10.0
# Nothing is authenticated on the virtual clock; the params still carry a well-formed secret.
TRANSFER_SECRET = "0" * 64


class KVFabric:
    """All connectors of one run. ``seconds(num_bytes)`` is the profiled transfer time."""

    def __init__(self, loop: EventLoop, seconds: Callable[[int], float], block_bytes: int) -> None:
        self.loop = loop
        self._seconds = seconds
        self._block_bytes = block_bytes
        self._connectors: dict[str, SimConnector] = {}
        self._link_free: dict[str, float] = {}
        self.num_transfers = 0
        self.bytes_moved = 0

    def connector(self, engine_id: str, wake: Callable[[], None]) -> SimConnector:
        conn = SimConnector(self, engine_id, wake)
        self._connectors[engine_id] = conn
        return conn

    def pull(self, dst: SimConnector, request_id: str, params: KVTransferParams, n: int) -> None:
        src = self._connectors[params.engine_id]
        num_bytes = n * self._block_bytes
        start = max(self.loop.now, self._link_free.get(src.engine_id, 0.0))
        end = start + (self._seconds(num_bytes) if n else 0.0)
        self._link_free[src.engine_id] = end
        self.num_transfers += 1
        self.bytes_moved += num_bytes

        def done() -> None:
            aborted = request_id in dst.aborted
            dst.aborted.discard(request_id)
            reason = FailureReason.ABORTED if aborted else None
            dst.finished.append(LoadResult(request_id, not aborted, reason))
            src.on_served()
            src.release(params.remote_request_id)
            dst.wake()

        self.loop.at(end, done)


class SimConnector:
    """Implements ``tandem.engine.kv_connector.KVConnector`` for one simulated worker."""

    side_channel_address = SIDE_CHANNEL

    def __init__(self, fabric: KVFabric, engine_id: str, wake: Callable[[], None]) -> None:
        self.fabric = fabric
        self.engine_id = engine_id
        self.wake = wake
        self.released: list[str] = []
        self.finished: list[LoadResult] = []
        self.aborted: set[str] = set()
        self._published: set[str] = set()
        # Called as each pull of this worker's blocks completes (the worker serves its side of
        # the transfer from then on; a step that starts meanwhile waits for the rest).
        self.on_served: Callable[[], None] = lambda: None

    def release(self, request_id: str) -> None:
        if request_id in self._published:
            self._published.discard(request_id)
            self.released.append(request_id)
            self.wake()

    # ---- KVConnector -----------------------------------------------------------------------
    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        self._published.add(request_id)
        return KVTransferParams(
            engine_id=self.engine_id,
            side_channel=SIDE_CHANNEL,
            remote_request_id=request_id,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            first_token_id=first_token_id,
            lease_seconds=LEASE_SECONDS,
            transfer_secret=TRANSFER_SECRET,
        )

    def take_released(self) -> list[str]:
        out, self.released = self.released, []
        return out

    def hold(self, request_id: str, params: KVTransferParams) -> None:
        return None  # a held lease is renewed until the pull; nothing expires here

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        self.fabric.pull(self, request_id, params, len(remote_block_ids))

    def take_finished_loads(self) -> list[LoadResult]:
        out, self.finished = self.finished, []
        return out

    def abort(self, request_id: str) -> None:
        if request_id in self._published:
            self.release(request_id)
        else:
            self.aborted.add(request_id)

    def close(self) -> None:
        return None
