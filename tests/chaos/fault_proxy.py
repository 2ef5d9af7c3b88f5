"""A fault-injecting TCP proxy for the chaos suite (asyncio, on its own thread): there is no
``tc netem`` here, so faults on the KV data path are made by putting this between the workers.

A worker started with ``--advertise-host 127.0.0.2`` (or ``TANDEM_ADVERTISE_HOST``) binds
127.0.0.1 but tells everyone to dial 127.0.0.2; the proxy listens on 127.0.0.2 at each of the
worker's ports and forwards to 127.0.0.1. Per port, a mode:

- ``pass``: forward both ways;
- ``stall``: stop forwarding (bytes are held, connections stay open): a transfer that hangs;
- ``drop``: reset every connection of the port the moment it carries data, then let the peer
  reconnect: a transfer cut mid-way.

``ports_of(pid)`` finds the TCP ports a process listens on (from /proc), so the proxy can mirror
a worker whose data-channel port is known only to its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import Counter
from pathlib import Path

PASS, STALL, DROP = "pass", "stall", "drop"
_CHUNK = 1 << 16


def ports_of(pid: int, host_hex: str = "0100007F") -> set[int]:
    """TCP ports process ``pid`` listens on at 127.0.0.1."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        addr, state, inode = cols[1], cols[3], cols[9]
        ip, port = addr.split(":")
        if state == "0A" and inode in inodes and ip == host_hex:
            ports.add(int(port, 16))
    return ports


class FaultProxy:
    """Start with ``start()``; every method is thread-safe. ``stats`` counts, per port, bytes
    forwarded, connections accepted and connections dropped."""

    def __init__(self, listen_host: str = "127.0.0.2", target_host: str = "127.0.0.1") -> None:
        self.listen_host = listen_host
        self.target_host = target_host
        self.stats: Counter[str] = Counter()
        self._modes: dict[int, str] = {}
        self._servers: dict[int, asyncio.Server] = {}
        self._conns: dict[int, set[asyncio.StreamWriter]] = {}
        self._resume: dict[int, asyncio.Event] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        async def shutdown() -> None:
            for server in self._servers.values():
                server.close()
            for conns in self._conns.values():
                for w in conns:
                    w.transport.abort()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def forward(self, port: int) -> None:
        """Listen on listen_host:port, forward to target_host:port (idempotent)."""
        asyncio.run_coroutine_threadsafe(self._forward(port), self._loop).result(10)

    def set_mode(self, port: int, mode: str) -> None:
        assert mode in (PASS, STALL, DROP)

        def apply() -> None:
            self._modes[port] = mode
            ev = self._resume.setdefault(port, asyncio.Event())
            if mode == STALL:
                ev.clear()
            else:
                ev.set()

        self._loop.call_soon_threadsafe(apply)

    async def _forward(self, port: int) -> None:
        if port in self._servers:
            return
        self._modes.setdefault(port, PASS)
        self._resume.setdefault(port, asyncio.Event()).set()
        self._conns[port] = set()
        self._servers[port] = await asyncio.start_server(
            lambda r, w: self._serve(port, r, w), self.listen_host, port
        )

    async def _serve(self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.stats[f"{port}:accepted"] += 1
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, port)
        except OSError:
            writer.transport.abort()
            return
        conns = self._conns[port]
        conns.update((writer, up_w))
        try:
            await asyncio.gather(
                self._pipe(port, reader, up_w, writer), self._pipe(port, up_r, writer, up_w)
            )
        finally:
            conns.discard(writer)
            conns.discard(up_w)
            for w in (writer, up_w):
                w.transport.abort()

    async def _pipe(
        self,
        port: int,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                await self._resume[port].wait()  # STALL holds the bytes here
                if self._modes[port] == DROP:
                    self.stats[f"{port}:dropped"] += 1
                    dst.transport.abort()
                    other.transport.abort()
                    return
                dst.write(data)
                self.stats[f"{port}:bytes"] += len(data)
                await dst.drain()
        with contextlib.suppress(ConnectionError, OSError):
            dst.write_eof()
