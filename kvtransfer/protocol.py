"""Side-channel wire protocol: message schema, version, limits and validation (pure functions).

Every side-channel frame is ``HMAC-SHA256(cluster token, body) || body`` (``seal`` / ``unseal``,
see ``auth.py``): a frame whose MAC does not verify is refused before its body is parsed. The
body is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type>, ...}``. Decode (DEALER) sends
HELLO, PULL, RENEW, RELEASE; prefill (ROUTER) answers HELLO_OK, PULL_ACCEPTED, PULL_DONE,
ABORTED and ERROR. PULL carries a proof of the transfer's secret bound to its transfer id and
blocks; RENEW and RELEASE carry a proof per request. Nothing is ever unpickled: msgpack maps of
plain scalars and lists only, with explicit per-field types and bounds. ``decode_message``
either returns a fully validated message or raises ``ProtocolError``; never partially checked
data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from tandem.engine.cluster_token import MAC_BYTES
from tandem.engine.kv_connector import MAX_BLOCKS_PER_REQUEST, MAX_ID_LEN
from tandem.engine.kv_layout import COMPATIBLE_FIELDS, KVLayout
from tandem.kvtransfer.auth import PROOF_HEX_CHARS, FrameAuth, Unauthorized

PROTOCOL_VERSION = 2  # 2: sealed frames, transfer proofs
MAX_MESSAGE_BYTES = 1 << 20  # a 2**16-block pull is ~400 KiB of msgpack; anything bigger is hostile
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + MAC_BYTES  # a sealed frame on the socket
MAX_RENEW_IDS = 2048  # ids of up to 256 characters and their proofs stay under the frame limit
MAX_TEXT_LEN = 1024
MAX_XFER_ID = (1 << 43) - 1  # UCX tags are xfer_id << 20 | segment, kept below bit 63
# "sim": simulated workers (sim_transport.py), which must never pair with real ones.
TRANSPORTS = ("ucx", "tcp", "sim")


class MsgType(StrEnum):
    HELLO = "hello"
    HELLO_OK = "hello_ok"
    PULL = "pull"
    PULL_ACCEPTED = "pull_ok"
    PULL_DONE = "pull_done"
    RENEW = "renew"
    RELEASE = "release"
    ABORTED = "aborted"
    ERROR = "error"


class ReleaseKind(StrEnum):
    """Why decode tells prefill to release: all of them free the prefill blocks."""

    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class ProtocolError(ValueError):
    """A frame that must be dropped; ``code`` is a short machine-readable label."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Hello:
    engine_id: str  # the sender's (decode) engine id
    transport: str
    layout: KVLayout
    fingerprint: str = "unset"  # engine/fingerprint.py digest; a mismatch is refused
    identity: str = "unset"  # its readable form, for the refusal's message


@dataclass(frozen=True, slots=True)
class HelloOk:
    engine_id: str  # the prefill engine id; decode compares it with KVTransferParams.engine_id
    transport: str
    layout: KVLayout
    data_address: str
    fingerprint: str = "unset"
    identity: str = "unset"


@dataclass(frozen=True, slots=True)
class Pull:
    engine_id: str  # target prefill engine id; a restarted prefill refuses its predecessor's ids
    request_id: str
    xfer_id: int
    segments: tuple[tuple[int, int], ...]  # (first remote block id, number of blocks)
    proof: str  # auth.pull_proof: the transfer's secret, bound to xfer_id and segments


@dataclass(frozen=True, slots=True)
class PullAccepted:
    """Prefill validated a PULL and is committed to send every segment (decode may post its
    receives now: it never posts a receive that nobody will ever satisfy)."""

    xfer_id: int


@dataclass(frozen=True, slots=True)
class PullDone:
    xfer_id: int
    ok: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class Renew:
    engine_id: str
    request_ids: tuple[str, ...]
    proofs: tuple[str, ...]  # auth.holder_proof of each request, in order


@dataclass(frozen=True, slots=True)
class Release:
    engine_id: str
    request_id: str
    kind: ReleaseKind
    proof: str  # auth.holder_proof


@dataclass(frozen=True, slots=True)
class Aborted:
    engine_id: str
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str
    request_id: str | None
    xfer_id: int | None


Message = Hello | HelloOk | Pull | PullAccepted | PullDone | Renew | Release | Aborted | Error


def _layout_wire(layout: KVLayout) -> dict[str, Any]:
    return layout.to_wire()


def encode_message(msg: Message) -> bytes:
    """Serialize a message; the sender's own messages are trusted dataclasses."""
    body: dict[str, Any]
    match msg:
        case Hello():
            body = {
                "t": MsgType.HELLO.value,
                "engine_id": msg.engine_id,
                "transport": msg.transport,
                "layout": _layout_wire(msg.layout),
                "fingerprint": msg.fingerprint,
                "identity": msg.identity,
            }
        case HelloOk():
            body = {
                "t": MsgType.HELLO_OK.value,
                "engine_id": msg.engine_id,
                "transport": msg.transport,
                "layout": _layout_wire(msg.layout),
                "data_address": msg.data_address,
                "fingerprint": msg.fingerprint,
                "identity": msg.identity,
            }
        case Pull():
            body = {
                "t": MsgType.PULL.value,
                "engine_id": msg.engine_id,
                "request_id": msg.request_id,
                "xfer_id": msg.xfer_id,
                "segments": [list(s) for s in msg.segments],
                "proof": msg.proof,
            }
        case PullAccepted():
            body = {"t": MsgType.PULL_ACCEPTED.value, "xfer_id": msg.xfer_id}
        case PullDone():
            body = {
                "t": MsgType.PULL_DONE.value,
                "xfer_id": msg.xfer_id,
                "ok": msg.ok,
                "reason": msg.reason,
            }
        case Renew():
            body = {
                "t": MsgType.RENEW.value,
                "engine_id": msg.engine_id,
                "request_ids": list(msg.request_ids),
                "proofs": list(msg.proofs),
            }
        case Release():
            body = {
                "t": MsgType.RELEASE.value,
                "engine_id": msg.engine_id,
                "request_id": msg.request_id,
                "kind": msg.kind.value,
                "proof": msg.proof,
            }
        case Aborted():
            body = {
                "t": MsgType.ABORTED.value,
                "engine_id": msg.engine_id,
                "request_id": msg.request_id,
                "reason": msg.reason,
            }
        case Error():
            body = {
                "t": MsgType.ERROR.value,
                "code": msg.code,
                "message": msg.message,
                "request_id": msg.request_id,
                "xfer_id": msg.xfer_id,
            }
        case _:
            raise TypeError(f"not a protocol message: {type(msg).__name__}")
    body["v"] = PROTOCOL_VERSION
    return msgpack.packb(body, use_bin_type=True)


def _field(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise ProtocolError("invalid_field", f"missing field {key!r}")
    return body[key]


def _str(
    body: dict[str, Any], key: str, max_len: int = MAX_ID_LEN, *, nullable: bool = False
) -> Any:
    value = _field(body, key)
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise ProtocolError("invalid_field", f"{key!r} must be a string of 1..{max_len} chars")
    return value


def _int(body: dict[str, Any], key: str, lo: int, hi: int, *, nullable: bool = False) -> Any:
    value = _field(body, key)
    if value is None and nullable:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError("invalid_field", f"{key!r} must be an int in [{lo}, {hi}]")
    return value


def _proof(body: dict[str, Any], key: str = "proof") -> str:
    value = _field(body, key)
    return _check_proof(value, key)


def _check_proof(value: Any, key: str) -> str:
    if (
        not isinstance(value, str)
        or len(value) != PROOF_HEX_CHARS
        or any(c not in "0123456789abcdef" for c in value)
    ):
        raise ProtocolError("invalid_field", f"{key!r} must be {PROOF_HEX_CHARS} hex characters")
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = _field(body, key)
    if type(value) is not bool:
        raise ProtocolError("invalid_field", f"{key!r} must be a bool")
    return value


def _transport(body: dict[str, Any]) -> str:
    value = _field(body, "transport")
    if value not in TRANSPORTS:
        raise ProtocolError("invalid_field", f"'transport' must be one of {TRANSPORTS}")
    return value


def _layout(body: dict[str, Any]) -> KVLayout:
    value = _field(body, "layout")
    keys = (*COMPATIBLE_FIELDS, "num_blocks")
    if not isinstance(value, dict) or set(value) != set(keys):
        raise ProtocolError("invalid_field", f"'layout' must be a map with keys {sorted(keys)}")
    try:
        return KVLayout(**{k: value[k] for k in keys})
    except (TypeError, ValueError) as exc:
        raise ProtocolError("invalid_field", f"'layout': {exc}") from None


def _segments(body: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    value = _field(body, "segments")
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS_PER_REQUEST:
        raise ProtocolError("invalid_field", "'segments' must be a non-empty list")
    out = []
    total = 0
    for seg in value:
        if (
            not isinstance(seg, list)
            or len(seg) != 2
            or any(type(x) is not int for x in seg)
            or seg[0] < 0
            or seg[1] < 1
        ):
            raise ProtocolError("invalid_field", "each segment must be [start >= 0, count >= 1]")
        total += seg[1]
        if total > MAX_BLOCKS_PER_REQUEST:
            raise ProtocolError("invalid_field", "too many blocks in one pull")
        out.append((seg[0], seg[1]))
    return tuple(out)


def decode_message(data: bytes) -> Message:
    """Parse and fully validate one side-channel frame, or raise ProtocolError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("oversized", f"{len(data)} bytes > limit {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("malformed", f"not a msgpack frame ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "frame is not a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"protocol version {body.get('v')!r} unsupported (want {PROTOCOL_VERSION})"
        )
    try:
        mtype = MsgType(body.get("t"))
    except ValueError:
        raise ProtocolError("unknown_type", f"unknown message type {body.get('t')!r}") from None
    match mtype:
        case MsgType.HELLO:
            return Hello(
                _str(body, "engine_id"),
                _transport(body),
                _layout(body),
                _str(body, "fingerprint", 64),
                _str(body, "identity", MAX_TEXT_LEN),
            )
        case MsgType.HELLO_OK:
            return HelloOk(
                _str(body, "engine_id"),
                _transport(body),
                _layout(body),
                _str(body, "data_address", MAX_TEXT_LEN),
                _str(body, "fingerprint", 64),
                _str(body, "identity", MAX_TEXT_LEN),
            )
        case MsgType.PULL:
            return Pull(
                _str(body, "engine_id"),
                _str(body, "request_id"),
                _int(body, "xfer_id", 0, MAX_XFER_ID),
                _segments(body),
                _proof(body),
            )
        case MsgType.PULL_ACCEPTED:
            return PullAccepted(_int(body, "xfer_id", 0, MAX_XFER_ID))
        case MsgType.PULL_DONE:
            return PullDone(
                _int(body, "xfer_id", 0, MAX_XFER_ID),
                _bool(body, "ok"),
                _str(body, "reason", MAX_TEXT_LEN, nullable=True),
            )
        case MsgType.RENEW:
            ids = _field(body, "request_ids")
            if not isinstance(ids, list) or len(ids) > MAX_RENEW_IDS:
                raise ProtocolError(
                    "invalid_field", f"'request_ids' must be a list of at most {MAX_RENEW_IDS}"
                )
            for rid in ids:
                if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_LEN:
                    raise ProtocolError("invalid_field", "'request_ids' entries must be ids")
            proofs = _field(body, "proofs")
            if not isinstance(proofs, list) or len(proofs) != len(ids):
                raise ProtocolError("invalid_field", "'proofs' must match 'request_ids'")
            for proof in proofs:
                _check_proof(proof, "proofs")
            return Renew(_str(body, "engine_id"), tuple(ids), tuple(proofs))
        case MsgType.RELEASE:
            try:
                kind = ReleaseKind(_field(body, "kind"))
            except ValueError:
                raise ProtocolError("invalid_field", "'kind' must be done|failed|aborted") from None
            return Release(_str(body, "engine_id"), _str(body, "request_id"), kind, _proof(body))
        case MsgType.ABORTED:
            return Aborted(
                _str(body, "engine_id"),
                _str(body, "request_id"),
                _str(body, "reason", MAX_TEXT_LEN),
            )
        case MsgType.ERROR:
            return Error(
                _str(body, "code", 64),
                _str(body, "message", MAX_TEXT_LEN),
                _str(body, "request_id", nullable=True),
                _int(body, "xfer_id", 0, MAX_XFER_ID, nullable=True),
            )
    raise AssertionError(mtype)  # pragma: no cover - the match is exhaustive


def seal(msg: Message, auth: FrameAuth) -> bytes:
    """One side-channel frame: the MAC under the cluster token, then the msgpack body."""
    return auth.seal(encode_message(msg))


def unseal(frame: bytes, auth: FrameAuth) -> Message:
    """Verify a frame's MAC, then parse it; ProtocolError ``unauthorized`` (never parsed) when
    the sender does not hold the cluster token."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("oversized", f"{len(frame)} bytes > limit {MAX_MESSAGE_BYTES}")
    try:
        body = auth.open(frame)
    except Unauthorized as exc:
        raise ProtocolError("unauthorized", str(exc)) from None
    return decode_message(body)


def check_pull_segments(
    segments: tuple[tuple[int, int], ...], published: frozenset[int], num_blocks: int
) -> str | None:
    """None if every requested block is in range and was published for this request, else why.

    A decode may pull any subset (its prefix cache may hold the rest) but never a block outside
    the request's own lease: that block may belong to another request.
    """
    seen: set[int] = set()
    for start, count in segments:
        if start + count > num_blocks:
            return f"blocks {start}..{start + count - 1} out of range (num_blocks {num_blocks})"
        for b in range(start, start + count):
            if b not in published:
                return f"block {b} is not part of this request"
            if b in seen:
                return f"block {b} requested twice"
            seen.add(b)
    return None


def plan_segments(
    remote_ids: list[int] | tuple[int, ...], local_ids: list[int] | tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """Coalesce a block mapping into (remote_start, local_start, count) runs.

    A run continues while both the remote and the local ids go up by one, so each run is one
    contiguous byte range on both sides and moves as a single message.
    """
    if len(remote_ids) != len(local_ids):
        raise ValueError("remote and local block id lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for r, loc in zip(remote_ids, local_ids, strict=True):
        if runs:
            r0, l0, n = runs[-1]
            if r == r0 + n and loc == l0 + n:
                runs[-1] = (r0, l0, n + 1)
                continue
        runs.append((r, loc, 1))
    return runs
