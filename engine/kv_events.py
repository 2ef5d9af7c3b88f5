"""KV events: the one definition of their types and wire codec (docs/internal-api.md).

A worker's block pool records BlockStored / BlockRemoved / AllCleared events (and its host KV tier
the same for host blocks, ``tier`` HOST); the worker shell's publisher sends them after each step as
``[TOPIC, encode_events(...)]`` over ZMQ PUB, and the router's subscriber decodes them with
``decode_batch``. Pure: msgpack only, no torch, no sockets, so the router imports this module
without pulling in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

from tandem.engine.hashing import BlockHash

TOPIC = b"kv"
VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# With a cluster token, subscribers log in with ZMQ PLAIN: this user name, the token as password.
PLAIN_USERNAME = b"tandem"


class KVEventKind(IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2


class BlockTier(IntEnum):
    """Where a worker holds a cached block: its device pool, or its host KV tier."""

    DEVICE = 0
    HOST = 1


# Wire names of the event kinds.
EVENT_NAMES = {
    KVEventKind.STORED: "stored",
    KVEventKind.REMOVED: "removed",
    KVEventKind.CLEARED: "cleared",
}
_KINDS = {name: kind for kind, name in EVENT_NAMES.items()}
# Wire names of the tiers. DEVICE is never written (an event without a tier is a device event, as
# from a worker that predates the host tier), so device events are byte-identical to version 1's.
TIER_NAMES = {BlockTier.DEVICE: "device", BlockTier.HOST: "host"}
_TIERS = {name: tier for tier, name in TIER_NAMES.items()}


@dataclass(slots=True, frozen=True)
class KVEvent:
    """A change to one tier's set of cached block hashes (CLEARED: that tier's whole set)."""

    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = ()
    tier: BlockTier = BlockTier.DEVICE


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    """One published message: ``seq`` counts messages per publisher from 0."""

    engine_id: str
    seq: int
    events: tuple[KVEvent, ...]


class MalformedEvent(ValueError):
    """A message that must be dropped (the subscriber then resyncs from a snapshot)."""


def encode_events(engine_id: str, seq: int, events: list[KVEvent]) -> bytes:
    """The payload frame of one message (tested exactly against the documented format)."""
    body = []
    for e in events:
        name = EVENT_NAMES[e.kind]
        item: list[Any] = [name] if e.kind == KVEventKind.CLEARED else [name, list(e.block_hashes)]
        if e.tier is not BlockTier.DEVICE:
            item.append(TIER_NAMES[e.tier])
        body.append(item)
    return msgpack.packb({"v": VERSION, "engine_id": engine_id, "seq": seq, "events": body})


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame; raises MalformedEvent naming what is wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise MalformedEvent(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedEvent(f"not msgpack: {exc}") from None
    if not isinstance(msg, dict):
        raise MalformedEvent("message is not a map")
    if msg.get("v") != VERSION:
        raise MalformedEvent(f"unsupported protocol version {msg.get('v')!r}")
    engine_id, seq, raw_events = msg.get("engine_id"), msg.get("seq"), msg.get("events")
    if not isinstance(engine_id, str):
        raise MalformedEvent("engine_id must be a string")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise MalformedEvent("seq must be a non-negative integer")
    if not isinstance(raw_events, list):
        raise MalformedEvent("events must be a list")
    return KVEventBatch(engine_id, seq, tuple(_decode_event(e) for e in raw_events))


def _decode_event(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str) or raw[0] not in _KINDS:
        raise MalformedEvent(f"unknown event {raw!r:.80}")
    kind = _KINDS[raw[0]]
    fields = 1 if kind is KVEventKind.CLEARED else 2
    if len(raw) not in (fields, fields + 1):
        raise MalformedEvent(f"{raw[0]} event has {len(raw) - 1} fields")
    tier = BlockTier.DEVICE
    if len(raw) == fields + 1:
        if not isinstance(raw[fields], str) or raw[fields] not in _TIERS:
            raise MalformedEvent(f"unknown tier {raw[fields]!r:.40}")
        tier = _TIERS[raw[fields]]
    if kind is KVEventKind.CLEARED:
        return KVEvent(kind, (), tier)
    if not isinstance(raw[1], list):
        raise MalformedEvent(f"{raw[0]} event needs a list of hashes")
    if not all(isinstance(h, bytes) for h in raw[1]):
        raise MalformedEvent(f"{raw[0]} hashes must be bytes")
    return KVEvent(kind, tuple(raw[1]), tier)
