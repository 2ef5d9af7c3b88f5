"""Client and registration bodies read under a cap (``engine/http_body.py``), as OpenAI errors.

Every router handler calls ``read_capped`` instead of ``request.body()``: an oversized body gets
413 while it arrives and is never held whole (``--max-request-bytes``).
"""

from __future__ import annotations

from fastapi import Request
from starlette.requests import ClientDisconnect

from tandem.engine import http_body
from tandem.router.errors import OpenAIError


async def read_capped(request: Request, max_bytes: int) -> bytes:
    """The whole body; 413 past ``max_bytes``, 400 for a malformed Content-Length."""
    try:
        return await http_body.read_capped(
            request.stream(), request.headers.get("content-length"), max_bytes
        )
    except http_body.BodyTooLarge as exc:
        raise OpenAIError(413, str(exc), code="request_too_large") from None
    except http_body.BadContentLength as exc:
        raise OpenAIError(400, str(exc), code="invalid_header") from None
    except ClientDisconnect:  # nobody will read the answer; 499 is what the logs will say
        raise OpenAIError(499, "The client disconnected while sending.") from None
