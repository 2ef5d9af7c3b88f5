"""Per-worker index of cached block hashes, fed by KV events, truthful under event loss.

The KV-event subscriber (``kv_events.py``) applies decoded batches here; placement asks
``tiered_overlap``. Each worker has two bounded LRUs, one per tier (``BlockTier``): the blocks in
its device pool (capacity = the worker's block count, so the index can never claim more than the
worker holds) and those in its host KV tier (capacity = the router's per-worker bound). Events
without a tier are device events (a worker without a host tier sends only those). An AllCleared
drops that tier's entries. A sequence gap or a foreign engine id drops both and marks the worker
unsynced until ``load_snapshot`` (the resync from ``/v1/internal/kv_blocks``). An unsynced worker,
or one whose events have gone quiet while the router expected some, reports zero overlap, so it is
scored by load alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from tandem.engine.hashing import BlockHash
from tandem.engine.kv_events import BlockTier, KVEventBatch, KVEventKind


class ApplyResult(IntEnum):
    APPLIED = 1
    IGNORED = 2  # an old or duplicate sequence number, or the worker is waiting for a snapshot
    NEEDS_RESYNC = 3


@dataclass(slots=True)
class _WorkerEntries:
    engine_id: str
    capacity: int
    hashes: OrderedDict[BlockHash, None]  # the device tier
    host_capacity: int
    host: OrderedDict[BlockHash, None]
    next_seq: int | None = None  # None: unsynced, overlap is not trusted
    expecting_since: float | None = None  # router sent work that should produce events

    def tier(self, tier: BlockTier) -> tuple[OrderedDict[BlockHash, None], int]:
        if tier is BlockTier.HOST:
            return self.host, self.host_capacity
        return self.hashes, self.capacity


@dataclass(slots=True, frozen=True)
class TieredOverlap:
    """A worker's match of a request: ``device`` leading blocks in its device pool, then ``host``
    more in its host tier (the engine matches exactly so: device first, the host continues)."""

    device: int = 0
    host: int = 0


class PrefixIndex:
    """Bounded per-worker sets of block hashes. Not thread-safe: used from the event loop."""

    def __init__(self, clock: Callable[[], float], events_stale_after_s: float = 5.0) -> None:
        self._clock = clock
        self._stale_after = events_stale_after_s
        self._workers: dict[str, _WorkerEntries] = {}

    def add_worker(self, engine_id: str, capacity: int, host_capacity: int | None = None) -> None:
        """Track a worker, unsynced until its first snapshot; ``host_capacity`` bounds its host
        tier's entries (default: ``capacity``)."""
        host_capacity = capacity if host_capacity is None else host_capacity
        self._workers[engine_id] = _WorkerEntries(
            engine_id, max(1, capacity), OrderedDict(), max(1, host_capacity), OrderedDict()
        )

    def remove_worker(self, engine_id: str) -> None:
        self._workers.pop(engine_id, None)

    def apply(self, engine_id: str, batch: KVEventBatch) -> ApplyResult:
        """Apply one event batch received for the worker registered as ``engine_id``."""
        w = self._workers.get(engine_id)
        if w is None:
            return ApplyResult.IGNORED
        if batch.engine_id != engine_id:
            self._desync(w)
            return ApplyResult.NEEDS_RESYNC
        if w.next_seq is None:
            return ApplyResult.IGNORED
        if batch.seq < w.next_seq:
            return ApplyResult.IGNORED
        if batch.seq > w.next_seq:
            self._desync(w)
            return ApplyResult.NEEDS_RESYNC
        w.next_seq = batch.seq + 1
        w.expecting_since = None
        for event in batch.events:
            held, capacity = w.tier(event.tier)
            if event.kind is KVEventKind.STORED:
                for h in event.block_hashes:
                    held[h] = None
                    held.move_to_end(h)
                while len(held) > capacity:
                    held.popitem(last=False)
            elif event.kind is KVEventKind.REMOVED:
                for h in event.block_hashes:
                    held.pop(h, None)
            else:
                held.clear()
        return ApplyResult.APPLIED

    def load_snapshot(
        self,
        engine_id: str,
        snapshot_engine_id: str,
        seq: int,
        hashes: Iterable[BlockHash],
        host_hashes: Iterable[BlockHash] = (),
    ) -> bool:
        """Replace a worker's entries with a snapshot; ``seq`` is the sequence number of the next
        message the worker will publish (the snapshot includes every message before it).

        Returns False (and leaves the worker unsynced) when the snapshot comes from another engine.
        """
        w = self._workers.get(engine_id)
        if w is None:
            return False
        if snapshot_engine_id != engine_id:
            self._desync(w)
            return False
        w.hashes = OrderedDict((h, None) for h in hashes)
        while len(w.hashes) > w.capacity:
            w.hashes.popitem(last=False)
        w.host = OrderedDict((h, None) for h in host_hashes)
        while len(w.host) > w.host_capacity:
            w.host.popitem(last=False)
        w.next_seq = seq
        w.expecting_since = None
        return True

    def mark_expecting(self, engine_id: str) -> None:
        """The router sent a request that will store new blocks: events should follow soon."""
        w = self._workers.get(engine_id)
        if w is not None and w.expecting_since is None:
            w.expecting_since = self._clock()

    def is_trusted(self, engine_id: str) -> bool:
        """Synced, and its events have not gone quiet while the router was expecting some."""
        w = self._workers.get(engine_id)
        if w is None or w.next_seq is None:
            return False
        if w.expecting_since is None:
            return True
        return self._clock() - w.expecting_since <= self._stale_after

    def is_synced(self, engine_id: str) -> bool:
        w = self._workers.get(engine_id)
        return w is not None and w.next_seq is not None

    def overlap(self, engine_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading request blocks the worker holds on its device; 0 when its entries
        are not trusted."""
        return self.tiered_overlap(engine_id, block_hashes).device

    def tiered_overlap(self, engine_id: str, block_hashes: Sequence[BlockHash]) -> TieredOverlap:
        """The leading request blocks the worker holds on its device, then those its host tier
        continues with; nothing when its entries are not trusted."""
        if not self.is_trusted(engine_id):
            return TieredOverlap()
        w = self._workers[engine_id]
        device = _run(w.hashes, block_hashes, 0)
        host = _run(w.host, block_hashes, device)
        return TieredOverlap(device, host - device)

    def invalidate(self, engine_id: str) -> None:
        """Forget a worker's entries until the next snapshot (e.g. after a malformed message)."""
        w = self._workers.get(engine_id)
        if w is not None:
            self._desync(w)

    def size(self, engine_id: str, tier: BlockTier = BlockTier.DEVICE) -> int:
        w = self._workers.get(engine_id)
        return len(w.tier(tier)[0]) if w is not None else 0

    def _desync(self, w: _WorkerEntries) -> None:
        w.hashes.clear()
        w.host.clear()
        w.next_seq = None
        w.expecting_since = None


def _run(held: OrderedDict[BlockHash, None], block_hashes: Sequence[BlockHash], start: int) -> int:
    """The end of the run of ``block_hashes[start:]`` all in ``held``."""
    n = start
    while n < len(block_hashes) and block_hashes[n] in held:
        n += 1
    return n
