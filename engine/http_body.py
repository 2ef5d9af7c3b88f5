"""Reading an HTTP request body under a cap: an oversized body is refused while it arrives.

Shared by the router (client and internal listeners) and the workers' internal API; torch- and
framework-free (it takes the ASGI body stream and the declared length). A declared
``Content-Length`` past the cap is refused before a byte is read; a chunked or lying body as
soon as what arrived passes the cap, so an oversized upload costs at most one ASGI message
beyond ``max_bytes``. The server then closes the connection (the rest is never buffered).
"""

from __future__ import annotations

from collections.abc import AsyncIterator


class BodyTooLarge(ValueError):
    """``size`` is the declared length, or None when the stream ran past the cap."""

    def __init__(self, max_bytes: int, size: int | None) -> None:
        what = f"{size} bytes" if size is not None else "larger than allowed"
        super().__init__(f"Request body is {what}; the limit is {max_bytes} bytes.")
        self.max_bytes = max_bytes
        self.size = size


class BadContentLength(ValueError):
    pass


def parse_content_length(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadContentLength("Content-Length is not a number.") from None
    if value < 0:
        raise BadContentLength("Content-Length is negative.")
    return value


async def read_capped(
    chunks: AsyncIterator[bytes], content_length: str | None, max_bytes: int
) -> bytes:
    """The whole body, or BodyTooLarge once it is known to exceed ``max_bytes``."""
    declared = parse_content_length(content_length)
    if declared is not None and declared > max_bytes:
        raise BodyTooLarge(max_bytes, declared)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes, None)
        if chunk:
            parts.append(chunk)
    return b"".join(parts)
