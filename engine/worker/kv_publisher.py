"""KVEventPublisher: a worker's ZMQ PUB of its block pool's KV events (codec: engine/kv_events)."""

from __future__ import annotations

import zmq

from tandem.engine.kv_events import TOPIC, KVEvent, encode_events


class KVEventPublisher:
    """Used only from the engine thread (ZMQ sockets are not thread-safe), after each step."""

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
            self._sock.send_multipart([TOPIC, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber that cannot keep up sees a sequence gap and resyncs

    def close(self) -> None:
        self._sock.close(0)
