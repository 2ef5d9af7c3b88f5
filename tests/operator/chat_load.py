"""Concurrent demo-task chat requests against a router, for the live autoscaler tests.

`ChatLoad` starts `concurrency` threads when entered; each sends demo questions in a closed
loop (one request in flight per thread) until the load is stopped or its per-thread cap is
reached, and checks every answer. The `with` block owns the threads and joins them on exit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

import httpx

from tandem.engine.demo import expected_answer, held_out_inputs, make_user_message


@dataclass(slots=True)
class LoadTally:
    sent: int = 0
    right: int = 0
    wrong: int = 0
    failed: int = 0


class ChatLoad:
    def __init__(
        self, base_url: str, concurrency: int, max_per_thread: int = 400, max_tokens: int = 16
    ) -> None:
        self._url = f"{base_url}/v1/chat/completions"
        self._concurrency = concurrency
        self._cap = max_per_thread
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._inputs = held_out_inputs(50)
        self.tally = LoadTally()
        self._threads: list[threading.Thread] = []

    def _worker(self, offset: int) -> None:
        with httpx.Client(timeout=30.0) as client:
            for i in range(self._cap):
                if self._stop.is_set():
                    return
                s = self._inputs[(offset + i) % len(self._inputs)]
                body = {
                    "model": "demo",
                    "messages": [{"role": "user", "content": make_user_message(s)}],
                    "temperature": 0,
                    "max_tokens": self._max_tokens,
                }
                try:
                    r = client.post(self._url, json=body)
                    answer = r.json()["choices"][0]["message"]["content"] if r.is_success else None
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    answer = None
                with self._lock:
                    self.tally.sent += 1
                    if answer is None:
                        self.tally.failed += 1
                    elif answer == expected_answer(s):
                        self.tally.right += 1
                    else:
                        self.tally.wrong += 1

    def snapshot(self) -> LoadTally:
        with self._lock:
            t = self.tally
            return LoadTally(t.sent, t.right, t.wrong, t.failed)

    def __enter__(self) -> ChatLoad:
        for n in range(self._concurrency):
            thread = threading.Thread(target=self._worker, args=(n * 7,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
