"""HTTP client of the worker internal API (docs/internal-api.md), with timeouts everywhere.

Owned by the app's lifespan (one ``aiohttp.ClientSession`` shared by all requests; aiohttp
streams measurably faster than httpx, see benchmarks/router_overhead.py). ``generate`` opens a
``GenerateStream`` that a background task pumps into a queue, so the caller can wait for the next
chunk with a short timeout, check the worker is still registered, and keep waiting, without
cancelling the HTTP read itself. The caller must ``aclose()`` every stream it opened.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.hashing import BlockHash

MAX_LINE_BYTES = 4 * 1024 * 1024  # one chunk; logprobs make the biggest


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
    control_s: float = 5.0  # abort, kv_blocks
    grant_s: float = 1.0  # a peer's prefix grant: past this the request recomputes instead


@dataclass(slots=True, frozen=True)
class KVSnapshot:
    """``/v1/internal/kv_blocks``: ``seq`` is the next event message the worker will publish."""

    engine_id: str
    seq: int
    block_hashes: list[BlockHash]
    host_block_hashes: list[BlockHash]


_DONE = object()
_NETWORK_ERRORS = (aiohttp.ClientError, TimeoutError)


class GenerateStream:
    """Chunks of one ``/v1/internal/generate`` call, in order."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        read_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(session, url, body, read_s, headers))

    async def _pump(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        read_s: float,
        headers: dict[str, str] | None,
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=read_s)
        try:
            async with session.post(url, json=body, timeout=timeout, headers=headers) as resp:
                if resp.status >= 400:
                    raw = await resp.content.read(64 * 1024)
                    self._queue.put_nowait(_http_error(resp.status, raw))
                    return
                while True:
                    line = await resp.content.readline()
                    if not line:
                        break
                    if not line.endswith(b"\n") and len(line) >= MAX_LINE_BYTES:
                        raise WorkerUnavailable("worker sent an oversized chunk")
                    if not line.strip():
                        continue
                    chunk = json.loads(line)
                    if not isinstance(chunk, dict):
                        raise WorkerUnavailable("worker sent a chunk that is not a JSON object")
                    self._queue.put_nowait(chunk)
            self._queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except WorkerUnavailable as exc:
            self._queue.put_nowait(exc)
        except (*_NETWORK_ERRORS, ValueError, UnicodeDecodeError) as exc:
            # ValueError covers bad JSON and aiohttp's "line too long".
            self._queue.put_nowait(WorkerUnavailable(f"{type(exc).__name__}: {exc}"))

    async def next_chunk(self, timeout_s: float) -> dict[str, Any] | None:
        """The next chunk; None at the end of the stream. Raises TimeoutError after ``timeout_s``
        with nothing received, and the worker's error when the call failed."""
        try:
            item = self._queue.get_nowait()  # the common case; wait_for costs a task per call
        except asyncio.QueueEmpty:
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
    """Calls workers' internal endpoints. Owns nothing: the app's lifespan owns ``session``.
    Every call carries the cluster token when the router has one."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        token: ClusterToken | None = None,
    ) -> None:
        self._session = session
        self.timeouts = timeouts
        self._control = aiohttp.ClientTimeout(total=timeouts.control_s)
        self._token = token

    def headers(self) -> dict[str, str] | None:
        return self._token.headers() if self._token is not None else None

    def generate(self, worker_url: str, body: dict[str, Any]) -> GenerateStream:
        url = f"{worker_url}/v1/internal/generate"
        return GenerateStream(self._session, url, body, self.timeouts.read_s, self.headers())

    async def abort(self, worker_url: str, request_id: str) -> bool:
        """Best effort: a failed abort is reported as False, never raised."""
        try:
            async with self._session.post(
                f"{worker_url}/v1/internal/abort",
                json={"request_id": request_id},
                timeout=self._control,
                headers=self.headers(),
            ) as resp:
                return resp.status == 200 and bool((await resp.json()).get("aborted"))
        except (*_NETWORK_ERRORS, ValueError, AttributeError):
            return False

    async def grant(self, worker_url: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """A peer's prefix grant (``/v1/internal/kv_grant``): its ``kv_transfer_params``, or
        None when it caches none of the prefix (404); WorkerUnavailable / WorkerRejected else."""
        try:
            async with self._session.post(
                f"{worker_url}/v1/internal/kv_grant", json=body, headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=self.timeouts.grant_s),
            ) as resp:  # fmt: skip
                raw = await resp.read()
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise _http_error(resp.status, raw)
            params = json.loads(raw)["kv_transfer_params"]
            if not isinstance(params, dict):
                raise ValueError("kv_transfer_params must be an object")
            return params
        except (*_NETWORK_ERRORS, ValueError, KeyError, TypeError) as exc:
            raise WorkerUnavailable(f"kv_grant failed: {exc}") from exc

    async def kv_blocks(self, worker_url: str) -> KVSnapshot:
        """The worker's cached-block snapshot; raises WorkerUnavailable. A worker without a host
        tier (or from before it) sends no ``host_block_hashes``."""
        try:
            async with self._session.get(
                f"{worker_url}/v1/internal/kv_blocks", timeout=self._control, headers=self.headers()
            ) as resp:
                resp.raise_for_status()
                body = await resp.json()
            hashes = [bytes.fromhex(h) for h in body["block_hashes"]]
            host = [bytes.fromhex(h) for h in body.get("host_block_hashes", [])]
            engine_id, seq = body["engine_id"], body["seq"]
            if not isinstance(engine_id, str) or not isinstance(seq, int):
                raise ValueError("engine_id must be a string and seq an integer")
            return KVSnapshot(engine_id, seq, hashes, host)
        except (*_NETWORK_ERRORS, ValueError, KeyError, TypeError) as exc:
            raise WorkerUnavailable(f"kv_blocks snapshot failed: {exc}") from exc
