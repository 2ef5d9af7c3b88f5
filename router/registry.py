"""The router's registry of live workers: register, heartbeat, deregister, expire.

Pure and synchronous with an injected clock; the app calls it from the registration endpoints and
from a periodic expiry task, and placement reads ``WorkerState`` snapshots. A worker re-registering
from the same URL with a new engine id (a restart) replaces the old entry.

A worker is who it first said it was: a live engine id stays bound to the registration it made
(URL, role, sizes) until it deregisters or expires; a different registration under that id is
refused with 409, so nobody can take over a live worker's slot. Every field is validated and
bounded (``url`` is ``scheme://host:port`` only; endpoints are ``tcp://host:port``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tandem.engine.role import Role
from tandem.router.errors import OpenAIError, bad_request

DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
MAX_WORKERS = 4096
MAX_ID_LEN = 256
MAX_NAME_LEN = 512
MAX_BLOCK_SIZE = 1024
MAX_MODEL_LEN = 1 << 24
MAX_NUM_BLOCKS = 1 << 26
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
_HOST_RE = re.compile(rf"^{_HOST}$")
_ZMQ_ENDPOINT_RE = re.compile(rf"^tcp://{_HOST}:([0-9]{{1,5}})$")
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{1,64}$")
_INT_LIMITS = {"block_size": MAX_BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
               "num_blocks": MAX_NUM_BLOCKS}  # fmt: skip


def conflict(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(409, message, param=param, code="conflict", type="invalid_request_error")


def check_worker_url(value: str) -> str:
    """``http(s)://host:port`` and nothing else (no path, query, credentials or fragment), so
    a registration can never point the router's requests at another path (SSRF)."""
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise bad_request("url must be http(s)://host:port", "url") from None
    if (
        parts.scheme not in ("http", "https")
        or port is None
        or not 0 < port < 65536
        or parts.path
        or parts.query
        or parts.fragment
        or "?" in url
        or "#" in url
        or "@" in parts.netloc
        or not _HOST_RE.match(parts.netloc.rsplit(":", 1)[0])
    ):
        raise bad_request("url must be http(s)://host:port with nothing after the port", "url")
    return url


def check_zmq_endpoint(value: str, param: str) -> str:
    m = _ZMQ_ENDPOINT_RE.match(value)
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise bad_request(f"{param} must be tcp://host:port", param)
    return value


def _parse_role(value: object) -> Role:
    try:
        return Role.parse(value)
    except ValueError as exc:
        raise bad_request(str(exc), "role") from None


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """What a worker tells the router at registration (docs/internal-api.md WorkerInfo)."""

    engine_id: str
    role: Role
    model: str
    url: str
    block_size: int
    hash_algorithm: str
    max_model_len: int
    num_blocks: int
    kv_events_endpoint: str | None
    kv_side_channel: str | None
    # engine/fingerprint.py digest: prefill and decode are paired only when equal (None: a
    # worker that sends none, which pairs only with others that send none).
    fingerprint: str | None = None
    max_num_seqs: int | None = None  # the worker's batch size (admission's default limit)

    @classmethod
    def from_json(cls, d: object) -> WorkerInfo:
        """Validate a registration body; raises a 400 OpenAIError naming the bad field."""
        if not isinstance(d, dict):
            raise bad_request("registration body must be a JSON object")
        strs = ("engine_id", "model", "url", "hash_algorithm")
        for key in strs:
            v = d.get(key)
            limit = MAX_ID_LEN if key == "engine_id" else MAX_NAME_LEN
            if not isinstance(v, str) or not 0 < len(v) <= limit:
                raise bad_request(f"{key} must be a non-empty string of at most {limit}", key)
        for key, limit in _INT_LIMITS.items():
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit:
                raise bad_request(f"{key} must be an integer in [1, {limit}]", key)
        for key in ("kv_events_endpoint", "kv_side_channel"):
            v = d.get(key)
            if v is not None and not isinstance(v, str):
                raise bad_request(f"{key} must be a string or null", key)
            if v:
                check_zmq_endpoint(v, key)
        seqs = d.get("max_num_seqs")
        if seqs is not None and (
            not isinstance(seqs, int) or isinstance(seqs, bool) or not 1 <= seqs <= 1 << 20
        ):
            raise bad_request("max_num_seqs must be an integer in [1, 2**20]", "max_num_seqs")
        url = check_worker_url(d["url"])
        fp = d.get("fingerprint")
        if fp is not None and (
            not isinstance(fp, str) or not _FINGERPRINT_RE.match(fp)
        ):  # fmt: skip
            raise bad_request("fingerprint must be 1..64 lowercase hex characters", "fingerprint")
        return cls(
            engine_id=d["engine_id"],
            role=_parse_role(d.get("role")),
            model=d["model"],
            url=url,
            block_size=d["block_size"],
            hash_algorithm=d["hash_algorithm"],
            max_model_len=d["max_model_len"],
            num_blocks=d["num_blocks"],
            kv_events_endpoint=d.get("kv_events_endpoint") or None,
            kv_side_channel=d.get("kv_side_channel"),
            fingerprint=fp,
            max_num_seqs=seqs,
        )


def check_against_router(info: WorkerInfo, hash_algorithm: str, max_context: int | None) -> None:
    """What only the router can check: the worker hashes blocks as the router does (or prefix
    scores would be wrong) and claims no more context than the served model has."""
    if info.hash_algorithm != hash_algorithm:
        raise bad_request(
            f"worker hashes blocks with {info.hash_algorithm!r}; this router uses "
            f"{hash_algorithm!r} (mixed Tandem versions?)",
            "hash_algorithm",
        )
    if max_context is not None and info.max_model_len > max_context:
        raise bad_request(
            f"max_model_len {info.max_model_len} exceeds the served model's context "
            f"({max_context} tokens)",
            "max_model_len",
        )
    if info.max_model_len < info.block_size:
        raise bad_request("max_model_len must be at least one block", "max_model_len")


@dataclass(slots=True, frozen=True)
class Heartbeat:
    engine_id: str
    running: int
    waiting: int
    kv_usage: float
    num_free_blocks: int

    @classmethod
    def from_json(cls, d: object) -> Heartbeat:
        if not isinstance(d, dict) or not isinstance(d.get("engine_id"), str):
            raise bad_request("heartbeat needs a string engine_id", "engine_id")
        for key in ("running", "waiting", "num_free_blocks"):
            v = d.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad_request(f"{key} must be a non-negative integer", key)
        usage = d.get("kv_usage", 0.0)
        if not isinstance(usage, int | float) or isinstance(usage, bool) or not 0 <= usage <= 1:
            raise bad_request("kv_usage must be a number in [0, 1]", "kv_usage")
        return cls(
            d["engine_id"],
            d.get("running", 0),
            d.get("waiting", 0),
            float(usage),
            d.get("num_free_blocks", 0),
        )


@dataclass(slots=True)
class WorkerState:
    """One registered worker: static info, its last reported load and the router's in-flight count.

    ``inflight`` counts sub-requests the router has sent and not yet finished; placement adds it to
    the reported load because heartbeats lag by up to a second.
    """

    info: WorkerInfo
    last_seen: float
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    inflight: int = 0
    failures: int = field(default=0)

    def describe(self) -> dict[str, Any]:
        return {
            "engine_id": self.info.engine_id,
            "role": self.info.role.label,
            "url": self.info.url,
            "fingerprint": self.info.fingerprint,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "inflight": self.inflight,
        }


class WorkerRegistry:
    """Live workers keyed by engine id. Not thread-safe: used from the app's event loop only."""

    def __init__(
        self,
        clock: Callable[[], float],
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        model: str | None = None,
    ) -> None:
        self._clock = clock
        self._timeout = heartbeat_timeout_s
        self._model = model
        self._workers: dict[str, WorkerState] = {}
        # How often each worker was lost (heartbeats stopped, or replaced by a restart at its
        # URL), as opposed to deregistering, after which it drains and its streams finish. A
        # stream notes the count when it starts; a change means its worker was lost meanwhile,
        # even if it has come back since (its streams were given up for migration). Bounded.
        self._losses: OrderedDict[str, int] = OrderedDict()

    def register(self, info: WorkerInfo) -> list[WorkerState]:
        """Add or refresh a worker; returns entries it replaced (same URL, older engine id)."""
        if self._model is not None and info.model != self._model:
            raise bad_request(
                f"worker serves model {info.model!r} but this router serves {self._model!r}",
                "model",
            )
        existing = self._workers.get(info.engine_id)
        if existing is not None and existing.info != info:
            field_name = next(
                (f for f in ("url", "role", "model") if getattr(existing.info, f) !=
                 getattr(info, f)), "engine_id",
            )  # fmt: skip
            raise conflict(
                f"engine_id {info.engine_id} is registered by another worker "
                f"({field_name} differs); it stays bound until it deregisters or expires",
                field_name,
            )
        if existing is None and len(self._workers) >= MAX_WORKERS:
            raise OpenAIError(503, f"the registry is full ({MAX_WORKERS} workers)",
                              code="registry_full")  # fmt: skip
        replaced = [
            w
            for w in self._workers.values()
            if w.info.url == info.url and w.info.engine_id != info.engine_id
        ]
        for old in replaced:
            del self._workers[old.info.engine_id]
            self._mark_lost(old.info.engine_id)
        if existing is not None:
            existing.last_seen = self._clock()
        else:
            self._workers[info.engine_id] = WorkerState(info=info, last_seen=self._clock())
        return replaced

    def heartbeat(self, hb: Heartbeat) -> bool:
        """Record a heartbeat; False means unknown engine (the worker must register again)."""
        w = self._workers.get(hb.engine_id)
        if w is None:
            return False
        w.last_seen = self._clock()
        w.running, w.waiting = hb.running, hb.waiting
        w.kv_usage, w.num_free_blocks = hb.kv_usage, hb.num_free_blocks
        return True

    def deregister(self, engine_id: str) -> WorkerState | None:
        return self._workers.pop(engine_id, None)

    def expire(self) -> list[WorkerState]:
        """Drop workers silent for longer than the heartbeat timeout; returns them."""
        deadline = self._clock() - self._timeout
        dead = [w for w in self._workers.values() if w.last_seen < deadline]
        for w in dead:
            del self._workers[w.info.engine_id]
            self._mark_lost(w.info.engine_id)
        return dead

    def _mark_lost(self, engine_id: str) -> None:
        self._losses[engine_id] = self._losses.pop(engine_id, 0) + 1
        while len(self._losses) > 4 * MAX_WORKERS:
            self._losses.popitem(last=False)

    def losses(self, engine_id: str) -> int:
        """How often this worker was dropped for lost heartbeats or replaced by a restart at its
        URL (deregistering, to drain, does not count). ``worker_stream`` compares the count at a
        stream's start with the current one."""
        return self._losses.get(engine_id, 0)

    def get(self, engine_id: str) -> WorkerState | None:
        return self._workers.get(engine_id)

    def is_live(self, engine_id: str) -> bool:
        return engine_id in self._workers

    def by_role(self, *roles: Role) -> list[WorkerState]:
        """Live workers of the given roles, in registration order (stable for round-robin)."""
        return [w for w in self._workers.values() if w.info.role in roles]

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def max_model_len(self) -> int | None:
        """The smallest context length among serving workers (None when there are none)."""
        lens = [w.info.max_model_len for w in self._workers.values()]
        return min(lens) if lens else None
