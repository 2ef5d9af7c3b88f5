"""The ITL canary: a few closed-loop chat streams timed per chunk, alongside guidellm's load.

guidellm records per request only the first and last token times, so a multi-second stall in a
240-token stream moves its mean ITL by a few milliseconds. The canary's streams have the bursty
workload's background shape (short prompt, long output) and record every chunk's arrival time: the
ITL tail and the timeline through a burst come from them. They run on their own thread and event
loop from ``start()`` to ``stop()``; a stream in flight at ``stop()`` is cancelled and kept as far
as it got.
"""

from __future__ import annotations

import asyncio
import random
import string
import threading
import time
from dataclasses import dataclass

import httpx
from benchlib.client import chat_body, stream_chat


@dataclass(slots=True)
class Stream:
    start: float  # time.time() when sent
    chunks: list[float]  # time.time() of each content chunk, as they arrived


def user_message(rng: random.Random, chars: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(chars))


class Canary:
    def __init__(self, url: str, model: str, streams: int, prompt_chars: int, max_tokens: int,
                 seed: int = 0, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.url, self.model = url, model
        self.streams, self.prompt_chars, self.max_tokens = streams, prompt_chars, max_tokens
        self.headers = headers or {}
        self.results: list[Stream] = []
        self.errors: list[str] = []
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    async def _stream(self, client: httpx.AsyncClient) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            msg = user_message(self._rng, self.prompt_chars)
            body = chat_body(self.model, (("user", msg),), self.max_tokens)
            stream = Stream(time.time(), [])
            self.results.append(stream)
            try:
                await stream_chat(client, self.url, body, stream.chunks)
            except (httpx.HTTPError, RuntimeError) as exc:
                self.errors.append(str(exc)[:200])
                await asyncio.sleep(0.5)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._ready.set()
        limits = httpx.Limits(max_connections=self.streams + 2)
        async with httpx.AsyncClient(timeout=600, headers=self.headers, limits=limits) as client:
            tasks = [asyncio.create_task(self._stream(client)) for _ in range(self.streams)]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> None:
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._main())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="itl-canary", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def stop(self) -> list[Stream]:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
        return list(self.results)
