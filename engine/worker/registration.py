"""Registrar: a worker's registration and heartbeat with the router (docs/internal-api.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

from tandem.engine.cluster_token import ClusterToken

log = logging.getLogger(__name__)


def refusal(status: int, text: str) -> str:
    """What to log when the router refuses us: the reason, never anything secret."""
    if status == 401:
        return (
            "the router refused our cluster token (401): this worker's --cluster-token-file or "
            "TANDEM_CLUSTER_TOKEN differs from the router's; it will not serve until they match"
        )
    return f"the router refused the registration ({status}): {text[:300]}"


class Registrar:
    """Runs on the worker's event loop. Registers, then heartbeats; re-registers on a 404 (the
    router restarted or dropped us) and retries on connection errors. Deregisters on stop.
    Every call carries the cluster token; a refusal is logged with its reason (once per kind,
    then again only if it changes)."""

    def __init__(
        self,
        router_url: str,
        info: Callable[[], dict[str, Any]],
        load: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
        token: ClusterToken | None = None,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self._info = info
        self._load = load
        self.interval_s = interval_s
        self._token = token
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._last_refusal: str | None = None
        self.registered = asyncio.Event()

    def _headers(self) -> dict[str, str]:
        return self._token.headers() if self._token is not None else {}

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
                    headers=self._headers(),
                )
        except httpx.HTTPError:
            pass

    def _refused(self, r: httpx.Response) -> None:
        why = refusal(r.status_code, r.text)
        if why != self._last_refusal:
            log.error("%s", why)
            self._last_refusal = why

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=max(2.0, self.interval_s * 2)) as client:
            registered = False
            while True:
                try:
                    if not registered:
                        r = await client.post(
                            f"{self.router_url}/internal/workers/register",
                            json=self._info(),
                            headers=self._headers(),
                        )
                        if 400 <= r.status_code < 500:
                            self._refused(r)
                        r.raise_for_status()
                        registered = True
                        self._last_refusal = None
                        self.registered.set()
                        log.info("registered with the router at %s", self.router_url)
                    else:
                        r = await client.post(
                            f"{self.router_url}/internal/workers/heartbeat",
                            json=self._load(),
                            headers=self._headers(),
                        )
                        if r.status_code == 404:
                            registered = False
                            self.registered.clear()
                            continue
                        if 400 <= r.status_code < 500:
                            self._refused(r)
                        r.raise_for_status()
                except httpx.HTTPError as exc:
                    log.debug("router unreachable: %s", exc)
                    registered = False
                    self.registered.clear()
                await asyncio.sleep(self.interval_s)
