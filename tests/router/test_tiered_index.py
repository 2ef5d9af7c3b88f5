"""The router knows the tiers: tiered KV events on the wire, the index's two tiers per worker,
and placement scoring a device hit above a host hit above a miss (exact scores)."""

from __future__ import annotations

import msgpack
import pytest

from tandem.engine.hashing import hash_block_tokens
from tandem.engine.kv_events import (
    BlockTier,
    KVEvent,
    KVEventBatch,
    KVEventKind,
    MalformedEvent,
    decode_batch,
    encode_events,
)
from tandem.router.placement import Candidate, Placer, Policy, Weights, score_of
from tandem.router.prefix_index import PrefixIndex, TieredOverlap

H = hash_block_tokens(list(range(40)), 4)  # ten chained block hashes
HOST = BlockTier.HOST


def test_tiered_events_wire_format_is_exact_and_device_events_are_unchanged() -> None:
    events = [
        KVEvent(KVEventKind.STORED, (H[0],)),
        KVEvent(KVEventKind.REMOVED, (H[0],)),
        KVEvent(KVEventKind.STORED, (H[0], H[1]), HOST),
        KVEvent(KVEventKind.REMOVED, (H[1],), HOST),
        KVEvent(KVEventKind.CLEARED, (), HOST),
        KVEvent(KVEventKind.CLEARED),
    ]
    payload = encode_events("e", 3, events)
    assert msgpack.unpackb(payload)["events"] == [
        ["stored", [H[0]]],
        ["removed", [H[0]]],
        ["stored", [H[0], H[1]], "host"],
        ["removed", [H[1]], "host"],
        ["cleared", "host"],
        ["cleared"],
    ]
    assert decode_batch(payload) == KVEventBatch("e", 3, tuple(events))


def test_a_worker_that_names_the_device_tier_or_none_is_read_alike() -> None:
    def wire(events: list) -> bytes:
        return msgpack.packb({"v": 1, "engine_id": "e", "seq": 0, "events": events})

    named = decode_batch(wire([["stored", [H[0]], "device"], ["cleared", "device"]]))
    plain = decode_batch(wire([["stored", [H[0]]], ["cleared"]]))
    assert named == plain
    assert plain.events[0].tier is BlockTier.DEVICE


@pytest.mark.parametrize(
    "event",
    [
        ["stored", [H[0]], "disk"],
        ["stored", [H[0]], 1],
        ["stored", [H[0]], ["host"]],
        ["stored", [H[0]], "host", "x"],
        ["cleared", "host", "x"],
        ["cleared", "gpu"],
        [["stored"], [H[0]]],
    ],
)
def test_malformed_tiers_are_refused(event: list) -> None:
    payload = msgpack.packb({"v": 1, "engine_id": "e", "seq": 0, "events": [event]})
    with pytest.raises(MalformedEvent):
        decode_batch(payload)


def synced(capacity: int = 100, host_capacity: int = 100) -> PrefixIndex:
    idx = PrefixIndex(lambda: 0.0)
    idx.add_worker("w", capacity, host_capacity)
    assert idx.load_snapshot("w", "w", 0, [])
    return idx


def apply(idx: PrefixIndex, seq: int, *events: KVEvent) -> None:
    idx.apply("w", KVEventBatch("w", seq, events))


def test_index_keeps_each_tier_and_matches_device_then_host() -> None:
    idx = synced()
    apply(idx, 0, KVEvent(KVEventKind.STORED, H[:2]), KVEvent(KVEventKind.STORED, H[:6], HOST))
    # Device run 0..1, the host continues 2..5 (it also holds 0..1: counted once, as device).
    assert idx.tiered_overlap("w", H) == TieredOverlap(device=2, host=4)
    assert idx.overlap("w", H) == 2
    # Offload: the device drops block 1, which the host still holds.
    apply(idx, 1, KVEvent(KVEventKind.REMOVED, (H[1],)))
    assert idx.tiered_overlap("w", H) == TieredOverlap(device=1, host=5)
    # Host eviction of block 3 ends the host run there; a device hit after it is not reached.
    apply(idx, 2, KVEvent(KVEventKind.REMOVED, (H[3],), HOST), KVEvent(KVEventKind.STORED, (H[4],)))
    assert idx.tiered_overlap("w", H) == TieredOverlap(device=1, host=2)
    # Only-host prefix.
    apply(idx, 3, KVEvent(KVEventKind.REMOVED, (H[0],)))
    assert idx.tiered_overlap("w", H) == TieredOverlap(device=0, host=3)
    # Clearing the host tier leaves the device's entries, and the reverse.
    apply(idx, 4, KVEvent(KVEventKind.CLEARED, (), HOST))
    assert (idx.size("w"), idx.size("w", HOST)) == (1, 0)
    apply(idx, 5, KVEvent(KVEventKind.STORED, (H[0],), HOST), KVEvent(KVEventKind.CLEARED))
    assert (idx.size("w"), idx.size("w", HOST)) == (0, 1)


def test_host_entries_are_bounded_and_dropped_with_the_device_ones() -> None:
    idx = synced(capacity=10, host_capacity=3)
    apply(idx, 0, KVEvent(KVEventKind.STORED, H[:5], HOST))
    assert idx.size("w", HOST) == 3 and idx.tiered_overlap("w", H) == TieredOverlap()
    apply(idx, 2, KVEvent(KVEventKind.STORED, H[:1]))  # a gap: both tiers are dropped
    assert (idx.size("w"), idx.size("w", HOST)) == (0, 0)
    assert idx.load_snapshot("w", "w", 7, H[:1], H[:4])
    # Bounded to the 3 last listed (1..3): block 0 is a device hit, the host continues 1..3.
    assert idx.tiered_overlap("w", H) == TieredOverlap(device=1, host=3)
    assert idx.size("w", HOST) == 3


def cand(eid: str, device: int = 0, host: int = 0, running: int = 0) -> Candidate:
    return Candidate(eid, device, 8, running, 0, 0.0, 0, host_overlap_blocks=host)


def test_tiered_score_is_exact() -> None:
    w = Weights()
    assert w.host_hit_weight == 0.5
    assert score_of(cand("a", device=4), w) == 4 / 8
    assert score_of(cand("a", host=4), w) == 0.5 * 4 / 8
    assert score_of(cand("a", device=2, host=4, running=1), w) == (2 + 0.5 * 4) / 8 - 1 / 4
    assert score_of(cand("a", host=4), Weights(host_hit_weight=1.0)) == 4 / 8
    with pytest.raises(ValueError, match="host_hit_weight"):
        Weights(host_hit_weight=1.5)


@pytest.mark.parametrize(
    ("cands", "expected", "reason"),
    [
        ([cand("miss"), cand("host", host=6), cand("dev", device=6)], "dev", "prefix_hit"),
        ([cand("miss"), cand("host", host=6)], "host", "host_hit"),
        # A host hit twice as long as a device hit scores equal: the device wins at lower load.
        ([cand("dev", device=3, running=1), cand("host", host=8)], "host", "host_hit"),
        ([cand("dev", device=4), cand("host", host=8, running=1)], "dev", "prefix_hit"),
    ],
)
def test_device_hit_beats_host_hit_beats_miss(
    cands: list[Candidate], expected: str, reason: str
) -> None:
    choice = Placer(Policy.PREFIX_AWARE).choose("decode", cands)
    assert (choice.engine_id, choice.reason) == (expected, reason)
    (c,) = [c for c in cands if c.engine_id == expected]
    assert choice.cached_blocks == c.overlap_blocks + c.host_overlap_blocks
