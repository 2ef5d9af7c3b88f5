"""Proofs on the KV connector: the cluster token on every channel, a transfer's secret on its pull.

Two credentials, both checked before anything is parsed or written (pure functions, no I/O):

- **The cluster token** (``engine/cluster_token.py``): every side-channel frame is sealed as
  ``HMAC-SHA256(token, body) || body`` and opened only if the MAC verifies, so a peer without the
  token is refused before its msgpack is even decoded. Data-channel connections (the TCP
  ``ready`` frame, the UCX connect message) carry ``HMAC(token, label || connection token)``.
- **A transfer's secret**: the sender issues one per published grant (a prefill's finished
  prompt today; a peer's cached prefix later: any block range the connector offers) and hands it
  out only in ``kv_transfer_params``, which travel through the authenticated router. A puller
  proves it holds the secret with ``pull_proof`` (bound to the transfer id and the exact blocks)
  and ``holder_proof`` (renew, release); the sender authenticates each TCP data message with
  ``data_mac``, which decode checks before copying a byte into its blocks. Transfer ids are
  random, so a UCX tag (``xfer_id << 20 | segment``) names one transfer nobody else can guess.

In-process connectors built without a token (tests) seal with an empty key: same format, no
authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Container, Sequence

from tandem.engine.cluster_token import MAC_BYTES, ClusterToken

SECRET_HEX_CHARS = 64  # 256-bit transfer secrets, hex in kv_transfer_params
PROOF_HEX_CHARS = 64
XFER_ID_BITS = 43  # UCX tags are xfer_id << 20 | segment, kept below bit 63
_EMPTY_KEY = b""


class Unauthorized(ValueError):
    """A frame or proof that does not verify; the message says which, never a secret."""


def new_transfer_secret() -> str:
    return secrets.token_hex(SECRET_HEX_CHARS // 2)


def new_xfer_id(in_use: Container[int]) -> int:
    """A random transfer id in [1, 2**43) not in ``in_use``: unguessable, so a peer cannot aim
    data at another transfer's tag."""
    while True:
        xfer = secrets.randbits(XFER_ID_BITS)
        if xfer and xfer not in in_use:
            return xfer


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


class FrameAuth:
    """Seals and opens side-channel frames and data-connection proofs under the cluster token."""

    def __init__(self, token: ClusterToken | None) -> None:
        self.token = token

    def _sign(self, data: bytes) -> bytes:
        if self.token is None:
            return hmac.new(_EMPTY_KEY, data, hashlib.sha256).digest()
        return self.token.sign(data)

    def _verify(self, data: bytes, mac: bytes) -> bool:
        if self.token is None:
            return hmac.compare_digest(hmac.new(_EMPTY_KEY, data, hashlib.sha256).digest(), mac)
        return self.token.verify(data, mac)

    def seal(self, body: bytes) -> bytes:
        return self._sign(body) + body

    def open(self, frame: bytes) -> bytes:
        """The body of a sealed frame; Unauthorized unless its MAC verifies."""
        if len(frame) < MAC_BYTES or not self._verify(frame[MAC_BYTES:], frame[:MAC_BYTES]):
            raise Unauthorized("frame is not signed with the cluster token")
        return frame[MAC_BYTES:]

    def connect_proof(self, label: bytes, conn_token: bytes) -> bytes:
        """Proof, for a data-channel connection, that the connecting peer holds the token."""
        return self._sign(b"tandem-kv-connect\0" + label + b"\0" + conn_token)

    def check_connect(self, label: bytes, conn_token: bytes, proof: bytes) -> bool:
        return self._verify(b"tandem-kv-connect\0" + label + b"\0" + conn_token, proof)


def _secret_key(secret: str) -> bytes:
    if len(secret) != SECRET_HEX_CHARS:
        raise Unauthorized("a transfer secret has 64 hex characters")
    try:
        return bytes.fromhex(secret)
    except ValueError:
        raise Unauthorized("a transfer secret is hex") from None


def _segments_bytes(segments: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(struct.pack("<QQ", start, count) for start, count in segments)


def pull_proof(
    secret: str,
    engine_id: str,
    request_id: str,
    xfer_id: int,
    segments: Sequence[tuple[int, int]],
) -> str:
    """What a PULL carries: bound to the sender engine, the grant, this transfer and its blocks,
    so a captured proof cannot fetch other blocks or feed another transfer id."""
    return _mac(
        _secret_key(secret),
        b"pull",
        engine_id.encode(),
        request_id.encode(),
        struct.pack("<Q", xfer_id),
        _segments_bytes(segments),
    ).hex()


def holder_proof(secret: str, engine_id: str, request_id: str) -> str:
    """What RENEW and RELEASE carry: only the grant's holder may extend or end it."""
    return _mac(_secret_key(secret), b"holder", engine_id.encode(), request_id.encode()).hex()


def data_mac(secret: str, xfer_id: int, sizes: Sequence[int]) -> bytes:
    """The sender's MAC over one TCP data message's header (transfer id and segment sizes)."""
    return _mac(
        _secret_key(secret),
        b"data",
        struct.pack("<Q", xfer_id),
        b"".join(struct.pack("<Q", n) for n in sizes),
    )


def proof_matches(expected: str, presented: str) -> bool:
    return hmac.compare_digest(expected.encode(), presented.encode())
