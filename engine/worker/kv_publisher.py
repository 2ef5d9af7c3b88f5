"""KVEventPublisher: a worker's ZMQ PUB of its block pool's KV events (codec: engine/kv_events).

With a cluster token the PUB socket is a ZMQ PLAIN server: every subscriber must log in with the
token as its password (checked in constant time by a ZAP handler on the publisher's own
context), so a peer without it cannot read which prefixes this worker caches. Without a token
(in-process tests) the socket is open.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.kv_events import PLAIN_USERNAME, TOPIC, KVEvent, encode_events

log = logging.getLogger(__name__)


class TokenAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler thread, with PLAIN passwords checked against the cluster token
    (constant time, every accepted token, re-read on rotation) instead of a fixed table."""

    def __init__(self, context: zmq.Context, token: ClusterToken) -> None:
        super().__init__(context, log=logging.getLogger("tandem.kv_events.auth"))
        self.token = token
        self.refused = 0

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if username.encode() == PLAIN_USERNAME and self.token.matches(password):
            return True, b"OK"
        self.refused += 1
        log.warning("kv events: refused a subscriber without the cluster token")
        return False, b"invalid cluster token"


class KVEventPublisher:
    """Used only from the engine thread (ZMQ sockets are not thread-safe), after each step."""

    def __init__(
        self,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: ClusterToken | None = None,
    ) -> None:
        self.engine_id = engine_id
        # Its own context: the ZAP handler applies to every socket of a context.
        self._ctx = zmq.Context()
        self._auth: TokenAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        if token is not None:
            self._auth = TokenAuthenticator(self._ctx, token)
            self._auth.start()
            self._sock.plain_server = True
            self._sock.zap_domain = b"tandem"
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.seq = 0

    @property
    def refused(self) -> int:
        """Subscribers refused for a missing or wrong token (tests, diagnostics)."""
        return self._auth.refused if self._auth is not None else 0

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
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
