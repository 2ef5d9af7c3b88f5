"""KVEventPublisher: the worker's ZMQ PUB of BlockStored/BlockRemoved/AllCleared (msgpack)."""

from __future__ import annotations

import msgpack
import zmq

from tandem.engine.block_pool import KVEvent, KVEventKind

EVENTS_TOPIC = b"kv"
EVENTS_VERSION = 1
# Wire names of the event kinds; the router decodes with the inverse of this map.
EVENT_NAMES = {
    KVEventKind.STORED: "stored",
    KVEventKind.REMOVED: "removed",
    KVEventKind.CLEARED: "cleared",
}


def encode_events(engine_id: str, seq: int, events: list[KVEvent]) -> bytes:
    """The wire payload of docs/internal-api.md (pure; tested exactly)."""
    body = []
    for e in events:
        name = EVENT_NAMES[e.kind]
        body.append([name] if e.kind == KVEventKind.CLEARED else [name, list(e.block_hashes)])
    return msgpack.packb({"v": EVENTS_VERSION, "engine_id": engine_id, "seq": seq, "events": body})


class KVEventPublisher:
    """Used only from the engine thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, engine_id: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine_id = engine_id
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_events(self.engine_id, self.seq, events)
        self.seq += 1
        try:
            self._sock.send_multipart([EVENTS_TOPIC, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber that cannot keep up sees a sequence gap and resyncs

    def close(self) -> None:
        self._sock.close(0)
