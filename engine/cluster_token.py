"""The cluster credential: one shared secret that every worker-facing channel requires.

Every component's CLI loads it once from ``--cluster-token-file PATH`` (in Kubernetes, the
TandemService's mounted Secret) or from the ``TANDEM_CLUSTER_TOKEN`` environment variable; never
from the command line, where ``ps`` would show it, and it is never logged (``repr`` hides it).
The router's internal listener, the workers' internal routes, the KV-event stream and the KV
side channel all require it (docs/security.md says which channel proves it how).

Rotation: a token file may hold several tokens, one per line. The first is the one this process
presents; every line is accepted. The file is re-read when it changes (looked at no more than
once a second), so a Secret updated in place reaches running pods without a restart: add the new
token as a second line everywhere, then make it the first, then drop the old one.

Torch-free and I/O-light: the router, the workers, the KV connector and ``tandem up`` share it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

CLUSTER_TOKEN_ENV = "TANDEM_CLUSTER_TOKEN"
AUTH_HEADER = "authorization"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
MAX_TOKENS = 4  # current + the ones a rotation is phasing in or out
MAC_BYTES = 32  # HMAC-SHA256
_RELOAD_EVERY_S = 1.0
_ALLOWED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~+/=")


class TokenError(ValueError):
    """A missing or malformed cluster token; the message never contains the token."""


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe): ``tandem up`` makes one per run."""
    return secrets.token_urlsafe(32)


def parse_tokens(text: str, source: str) -> tuple[str, ...]:
    """The tokens of a file or variable: one per non-empty line, the first presented."""
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not tokens:
        raise TokenError(f"{source} holds no cluster token")
    if len(tokens) > MAX_TOKENS:
        raise TokenError(f"{source} holds {len(tokens)} tokens; at most {MAX_TOKENS}")
    for i, tok in enumerate(tokens):
        if not MIN_TOKEN_CHARS <= len(tok) <= MAX_TOKEN_CHARS:
            raise TokenError(
                f"{source}: token {i + 1} has {len(tok)} characters; "
                f"{MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} are required"
            )
        if not set(tok) <= _ALLOWED:
            raise TokenError(
                f"{source}: token {i + 1} must be printable ASCII (base64 or hex characters)"
            )
    return tokens


class ClusterToken:
    """The accepted tokens of this process; thread-safe (the connector and the KV-event
    authenticator use it from their own threads)."""

    def __init__(
        self,
        tokens: Sequence[str],
        path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokens = parse_tokens("\n".join(tokens), "the cluster token")
        self._keys = tuple(t.encode() for t in self._tokens)
        self._path = path
        self._clock = clock
        self._mtime = _mtime(path) if path is not None else None
        self._checked = clock()
        self._lock = threading.Lock()

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], clock: Callable[[], float] = time.monotonic
    ) -> ClusterToken:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise TokenError(f"cannot read cluster token file {p}: {exc.strerror}") from None
        return cls(parse_tokens(text, f"cluster token file {p}"), path=p, clock=clock)

    @classmethod
    def load(cls, path: str | None, env: Mapping[str, str] | None = None) -> ClusterToken | None:
        """From ``path`` when given, else from ``$TANDEM_CLUSTER_TOKEN``; None when neither."""
        if path:
            return cls.from_file(path)
        value = (os.environ if env is None else env).get(CLUSTER_TOKEN_ENV, "")
        if not value.strip():
            return None
        return cls(parse_tokens(value, f"${CLUSTER_TOKEN_ENV}"))

    @classmethod
    def require(cls, path: str | None, env: Mapping[str, str] | None = None) -> ClusterToken:
        """``load``, or a TokenError telling the operator how to provide one."""
        token = cls.load(path, env)
        if token is None:
            raise TokenError(
                "no cluster token: pass --cluster-token-file PATH or set "
                f"{CLUSTER_TOKEN_ENV} (the same value on the router and every worker)"
            )
        return token

    def _refresh(self) -> None:
        """Re-read the file if it changed; a broken rewrite keeps the previous tokens."""
        if self._path is None:
            return
        now = self._clock()
        if now - self._checked < _RELOAD_EVERY_S:
            return
        with self._lock:
            self._checked = now
            mtime = _mtime(self._path)
            if mtime is None or mtime == self._mtime:
                return
            try:
                tokens = parse_tokens(self._path.read_text(), "cluster token file")
            except (OSError, TokenError):
                return  # mid-update or removed: keep what worked until it settles
            self._mtime = mtime
            self._tokens = tokens
            self._keys = tuple(t.encode() for t in tokens)

    # -- presenting ---------------------------------------------------------------------------
    @property
    def current(self) -> str:
        self._refresh()
        return self._tokens[0]

    def headers(self) -> dict[str, str]:
        """HTTP headers proving the token (every worker-facing HTTP call carries them)."""
        return {"Authorization": f"Bearer {self.current}"}

    def sign(self, data: bytes) -> bytes:
        """HMAC-SHA256 of ``data`` under the current token (side-channel frames)."""
        self._refresh()
        return hmac.new(self._keys[0], data, hashlib.sha256).digest()

    # -- checking -----------------------------------------------------------------------------
    def matches(self, presented: str | bytes | None) -> bool:
        """Constant-time: is ``presented`` one of the accepted tokens?"""
        if presented is None:
            return False
        raw = presented.encode() if isinstance(presented, str) else presented
        self._refresh()
        ok = False
        for key in self._keys:  # no early exit: the time does not say which one matched
            ok |= hmac.compare_digest(raw, key)
        return ok

    def authorizes(self, header: str | None) -> bool:
        """Whether an ``Authorization: Bearer <token>`` header value carries an accepted token."""
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and self.matches(value.strip())

    def verify(self, data: bytes, mac: bytes) -> bool:
        """Whether ``mac`` is the HMAC of ``data`` under one of the accepted tokens."""
        if len(mac) != MAC_BYTES:
            return False
        self._refresh()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(hmac.new(key, data, hashlib.sha256).digest(), mac)
        return ok

    def __repr__(self) -> str:  # never the token itself
        source = f"file {self._path}" if self._path is not None else "environment"
        return f"ClusterToken(<{len(self._tokens)} token(s) from {source}>)"

    __str__ = __repr__


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime_ns / 1e9
    except OSError:
        return None
