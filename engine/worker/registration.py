"""Registrar: a worker's registration and heartbeat with the router (docs/internal-api.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)


class Registrar:
    """Runs on the worker's event loop. Registers, then heartbeats; re-registers on a 404 (the
    router restarted or dropped us) and retries on connection errors. Deregisters on stop."""

    def __init__(
        self,
        router_url: str,
        info: Callable[[], dict[str, Any]],
        load: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self._info = info
        self._load = load
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop heartbeating and deregister; idempotent (drain, then shutdown, both call it)."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                await client.post(
                    f"{self.router_url}/internal/workers/deregister",
                    json={"engine_id": self._info()["engine_id"]},
                )
        except httpx.HTTPError:
            pass

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=max(2.0, self.interval_s * 2)) as client:
            registered = False
            while True:
                try:
                    if not registered:
                        r = await client.post(
                            f"{self.router_url}/internal/workers/register", json=self._info()
                        )
                        r.raise_for_status()
                        registered = True
                        self.registered.set()
                    else:
                        r = await client.post(
                            f"{self.router_url}/internal/workers/heartbeat", json=self._load()
                        )
                        if r.status_code == 404:
                            registered = False
                            self.registered.clear()
                            continue
                        r.raise_for_status()
                except httpx.HTTPError as exc:
                    log.debug("router unreachable: %s", exc)
                    registered = False
                    self.registered.clear()
                await asyncio.sleep(self.interval_s)
