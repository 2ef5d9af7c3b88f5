"""RouterSet: a worker registers and heartbeats with every router replica, not one of them.

Each ``--router-url`` may name one router or, through a headless Service (the operator renders
``<name>-router-internal``), every router pod: the set resolves each URL's host to all its
addresses, runs one ``Registrar`` per address, and re-resolves every ``resolve_interval_s`` so a
router pod that appears is registered with and one that disappears is forgotten (deregistered,
best effort). Behind a normal Service, kube-proxy would balance each worker onto one replica and
the others would never learn about it.

Runs on the worker's event loop; resolution happens on a thread (``getaddrinfo`` blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.worker.registration import Registrar

log = logging.getLogger(__name__)
Resolver = Callable[[str, int], list[str]]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, sorted."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def endpoints(urls: Sequence[str], resolve: Resolver) -> list[str]:
    """The router endpoints ``urls`` stand for: one ``scheme://address:port`` per address."""
    out: list[str] = []
    for url in urls:
        parts = urlsplit(url.rstrip("/"))
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        try:
            addresses = [host] if _is_ip(host) else resolve(host, port)
        except OSError as exc:
            log.warning("cannot resolve router %s yet: %s", url, exc)
            continue
        for addr in addresses:
            shown = f"[{addr}]" if ":" in addr else addr
            endpoint = f"{parts.scheme}://{shown}:{port}"
            if endpoint not in out:
                out.append(endpoint)
    return out


class RouterSet:
    """Registrars for every router endpoint, kept in step with DNS. ``stop`` deregisters all."""

    def __init__(
        self,
        urls: Sequence[str],
        info: Callable[[], dict[str, Any]],
        load: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
        token: ClusterToken | None = None,
        resolve_interval_s: float = 5.0,
        resolve: Resolver = resolve_host,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._info, self._load = info, load
        self._interval = interval_s
        self._token = token
        self._resolve_interval = resolve_interval_s
        self._resolve = resolve
        self.registrars: dict[str, Registrar] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def registered(self) -> list[str]:
        """Endpoints this worker is registered with right now."""
        return [e for e, r in self.registrars.items() if r.registered.is_set()]

    async def refresh(self) -> None:
        """Resolve once and start / stop registrars to match."""
        current = await asyncio.to_thread(endpoints, self.urls, self._resolve)
        if not current and self.registrars:
            return  # a resolution hiccup: keep the routers we know rather than drop them all
        for endpoint in current:
            if endpoint not in self.registrars:
                r = Registrar(endpoint, self._info, self._load, self._interval, self._token)
                r.start()
                self.registrars[endpoint] = r
                log.info("registering with router %s", endpoint)
        for endpoint in [e for e in self.registrars if e not in current]:
            log.info("router %s is gone from DNS; forgetting it", endpoint)
            await self.registrars.pop(endpoint).stop()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let one bad resolution end registration
                log.exception("router resolution failed")
            await asyncio.sleep(self._resolve_interval)

    async def stop(self) -> None:
        """Stop resolving, then deregister from every router; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(r.stop() for r in self.registrars.values()))
