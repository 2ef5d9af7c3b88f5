"""HTTP client of the worker internal API (docs/internal-api.md), with timeouts everywhere.

Owned by the app's lifespan (one ``httpx.AsyncClient`` shared by all requests). ``generate`` opens a
``GenerateStream`` that a background task pumps into a queue, so the caller can wait for the next
chunk with a short timeout, check the worker is still registered, and keep waiting, without
cancelling the HTTP read itself. The caller must ``aclose()`` every stream it opened.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.engine.hashing import BlockHash

MAX_LINE_BYTES = 16 * 1024 * 1024


class WorkerUnavailable(Exception):
    """Connection error, timeout, 5xx or a broken stream: the request may go elsewhere."""


class WorkerRejected(Exception):
    """A 4xx from the worker: the client's request is at fault and gets this error back."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", f"worker answered {status}"))
        self.status = status
        self.error = error


@dataclass(slots=True, frozen=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 300.0  # longest silence inside a generate stream (long prefills)
    control_s: float = 5.0  # abort, kv_blocks, health


_DONE = object()


class GenerateStream:
    """Chunks of one ``/v1/internal/generate`` call, in order."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(client, url, body))

    async def _pump(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        try:
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code >= 400:
                    raw = await resp.aread()
                    self._queue.put_nowait(_http_error(resp.status_code, raw))
                    return
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    if len(line) > MAX_LINE_BYTES:
                        raise WorkerUnavailable("worker sent an oversized chunk")
                    chunk = json.loads(line)
                    if not isinstance(chunk, dict):
                        raise WorkerUnavailable("worker sent a chunk that is not a JSON object")
                    self._queue.put_nowait(chunk)
            self._queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except WorkerUnavailable as exc:
            self._queue.put_nowait(exc)
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._queue.put_nowait(WorkerUnavailable(f"{type(exc).__name__}: {exc}"))

    async def next_chunk(self, timeout_s: float) -> dict[str, Any] | None:
        """The next chunk; None at the end of the stream. Raises TimeoutError after ``timeout_s``
        with nothing received, and the worker's error when the call failed."""
        item = await asyncio.wait_for(self._queue.get(), timeout_s)
        if item is _DONE:
            return None
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing must not raise
            pass


def _http_error(status: int, raw: bytes) -> Exception:
    try:
        body = json.loads(raw)
        error = body.get("error") if isinstance(body, dict) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        error = None
    if not isinstance(error, dict):
        error = {"message": raw[:500].decode(errors="replace") or f"HTTP {status}"}
    if 400 <= status < 500:
        return WorkerRejected(status, error)
    return WorkerUnavailable(f"worker answered {status}: {error.get('message')}")


class WorkerClient:
    """Calls workers' internal endpoints. Owns nothing: the app's lifespan owns ``client``."""

    def __init__(self, client: httpx.AsyncClient, timeouts: Timeouts) -> None:
        self._client = client
        self.timeouts = timeouts

    def generate(self, worker_url: str, body: dict[str, Any]) -> GenerateStream:
        return GenerateStream(self._client, f"{worker_url}/v1/internal/generate", body)

    async def abort(self, worker_url: str, request_id: str) -> bool:
        """Best effort: a failed abort is reported as False, never raised."""
        try:
            resp = await self._client.post(
                f"{worker_url}/v1/internal/abort",
                json={"request_id": request_id},
                timeout=self.timeouts.control_s,
            )
            return resp.status_code == 200 and bool(resp.json().get("aborted"))
        except (httpx.HTTPError, ValueError):
            return False

    async def kv_blocks(self, worker_url: str) -> tuple[str, int, list[BlockHash]]:
        """The worker's cached-block snapshot (engine_id, seq, hashes); raises WorkerUnavailable."""
        try:
            resp = await self._client.get(
                f"{worker_url}/v1/internal/kv_blocks", timeout=self.timeouts.control_s
            )
            resp.raise_for_status()
            body = resp.json()
            hashes = [bytes.fromhex(h) for h in body["block_hashes"]]
            engine_id, seq = body["engine_id"], body["seq"]
            if not isinstance(engine_id, str) or not isinstance(seq, int):
                raise ValueError("engine_id must be a string and seq an integer")
            return engine_id, seq, hashes
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise WorkerUnavailable(f"kv_blocks snapshot failed: {exc}") from exc
