"""ASGI middleware that requires the cluster token on worker-facing HTTP routes.

The router's internal listener wraps every route in it; a worker wraps its internal API
(``/info`` and ``/v1/internal/*``) and leaves ``/health`` and ``/metrics`` open for probes and
Prometheus. A request without an accepted ``Authorization: Bearer <cluster token>`` gets 401
before its route runs or its body is read. Pure ASGI (no framework), so it costs one header scan
and a constant-time compare per request; torch-free, shared by router and workers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tandem.engine.cluster_token import ClusterToken

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BODY = json.dumps(
    {
        "error": {
            "message": "This route requires the cluster token (Authorization: Bearer ...).",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_cluster_token",
        }
    }
).encode()


def all_paths(_: str) -> bool:
    return True


class ClusterAuth:
    """Wraps ``app``; ``protects(path)`` picks the routes that need the token."""

    def __init__(
        self,
        app: ASGIApp,
        token: ClusterToken | None,
        protects: Callable[[str], bool] = all_paths,
    ) -> None:
        self.app = app
        self.token = token
        self.protects = protects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if self.token.authorizes(header):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        log.warning(
            "refused %s %s from %s: %s cluster token",
            scope.get("method"), scope["path"], f"{client[0]}:{client[1]}" if client else "?",
            "wrong" if header else "no",
        )  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_BODY)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _BODY})
