"""PrefixIndex stays truthful under event loss; event messages decode strictly."""

from __future__ import annotations

import msgpack
import pytest

from tandem.engine.hashing import hash_block_tokens
from tandem.engine.kv_events import TOPIC, KVEventBatch, MalformedEvent, decode_batch, encode_events
from tandem.engine.kv_events import KVEvent as KvEvent
from tandem.engine.kv_events import KVEventKind as EventKind
from tandem.router.prefix_index import ApplyResult, PrefixIndex

H = hash_block_tokens(list(range(40)), 4)  # ten chained block hashes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(*hs: bytes) -> KvEvent:
    return KvEvent(EventKind.STORED, tuple(hs))


def synced_index(capacity: int = 100) -> tuple[PrefixIndex, Clock]:
    clock = Clock()
    idx = PrefixIndex(clock, events_stale_after_s=5.0)
    idx.add_worker("w", capacity)
    assert idx.load_snapshot("w", "w", 0, [])
    return idx, clock


def test_unsynced_worker_reports_no_overlap_and_ignores_events() -> None:
    idx = PrefixIndex(Clock())
    idx.add_worker("w", 10)
    assert idx.apply("w", KVEventBatch("w", 0, (stored(H[0]),))) is ApplyResult.IGNORED
    assert idx.overlap("w", H[:1]) == 0


def test_overlap_counts_leading_blocks_only() -> None:
    idx, _ = synced_index()
    assert idx.apply("w", KVEventBatch("w", 0, (stored(H[0], H[1], H[3]),))) is ApplyResult.APPLIED
    assert idx.overlap("w", H) == 2
    assert idx.overlap("w", H[1:]) == 1
    assert idx.overlap("other", H) == 0


def test_removed_and_cleared() -> None:
    idx, _ = synced_index()
    idx.apply("w", KVEventBatch("w", 0, (stored(*H[:4]),)))
    idx.apply("w", KVEventBatch("w", 1, (KvEvent(EventKind.REMOVED, (H[2],)),)))
    assert idx.overlap("w", H) == 2
    idx.apply("w", KVEventBatch("w", 2, (KvEvent(EventKind.CLEARED),)))
    assert idx.overlap("w", H) == 0
    assert idx.is_synced("w")


def test_sequence_gap_drops_entries_until_snapshot() -> None:
    idx, _ = synced_index()
    idx.apply("w", KVEventBatch("w", 0, (stored(*H[:3]),)))
    assert idx.apply("w", KVEventBatch("w", 2, (stored(H[3]),))) is ApplyResult.NEEDS_RESYNC
    assert idx.overlap("w", H) == 0 and not idx.is_synced("w")
    assert idx.load_snapshot("w", "w", 6, H[:5])  # includes messages 0..5
    assert idx.overlap("w", H) == 5
    # Events already in the snapshot are skipped; the next one applies.
    assert idx.apply("w", KVEventBatch("w", 5, (stored(H[9]),))) is ApplyResult.IGNORED
    assert idx.apply("w", KVEventBatch("w", 6, (stored(H[5]),))) is ApplyResult.APPLIED
    assert idx.overlap("w", H) == 6


def test_new_engine_id_drops_entries() -> None:
    idx, _ = synced_index()
    idx.apply("w", KVEventBatch("w", 0, (stored(*H[:3]),)))
    assert idx.apply("w", KVEventBatch("w2", 1, ())) is ApplyResult.NEEDS_RESYNC
    assert idx.overlap("w", H) == 0
    assert not idx.load_snapshot("w", "w2", 0, H)  # a snapshot from another engine is refused
    assert idx.overlap("w", H) == 0


def test_capacity_evicts_oldest() -> None:
    idx, _ = synced_index(capacity=3)
    idx.apply("w", KVEventBatch("w", 0, (stored(*H[:5]),)))
    assert idx.size("w") == 3
    assert idx.overlap("w", H) == 0  # the first blocks were evicted
    assert idx.overlap("w", H[2:]) == 3


def test_quiet_events_fall_back_to_load_until_they_resume() -> None:
    idx, clock = synced_index()
    idx.apply("w", KVEventBatch("w", 0, (stored(*H[:2]),)))
    idx.mark_expecting("w")
    clock.now += 5.0
    assert idx.overlap("w", H) == 2
    clock.now += 0.1
    assert idx.overlap("w", H) == 0 and not idx.is_trusted("w")
    idx.apply("w", KVEventBatch("w", 1, (stored(H[2]),)))
    assert idx.overlap("w", H) == 3


def test_decode_batch_roundtrip_and_rejections() -> None:
    payload = encode_events(
        "e", 3, [stored(H[0]), KvEvent(EventKind.REMOVED, (H[1],)), KvEvent(EventKind.CLEARED)]
    )
    assert TOPIC == b"kv"
    batch = decode_batch(payload)
    assert batch == KVEventBatch(
        "e", 3,
        (stored(H[0]), KvEvent(EventKind.REMOVED, (H[1],)), KvEvent(EventKind.CLEARED)),
    )  # fmt: skip
    bad = [
        b"\xc1garbage",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2, "engine_id": "e", "seq": 0, "events": []}),
        msgpack.packb({"v": 1, "engine_id": 5, "seq": 0, "events": []}),
        msgpack.packb({"v": 1, "engine_id": "e", "seq": -1, "events": []}),
        msgpack.packb({"v": 1, "engine_id": "e", "seq": 0, "events": [["exploded"]]}),
        msgpack.packb({"v": 1, "engine_id": "e", "seq": 0, "events": [["stored", ["hex"]]]}),
    ]
    for payload in bad:
        with pytest.raises(MalformedEvent):
            decode_batch(payload)
