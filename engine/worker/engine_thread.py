"""EngineThread: runs the engine's step loop on its own thread so request handling never stalls it.

Other threads (the worker's asyncio loop) only ever reach the engine through ``call``; outputs come
back through per-request sinks, which must be cheap and thread-safe (e.g. call_soon_threadsafe).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tandem.engine.engine import Engine
from tandem.engine.outputs import EngineOutput, EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")
Sink = Callable[[EngineOutput], None]


class EngineThread:
    def __init__(
        self,
        engine: Engine,
        after_step: Callable[[Engine], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self._after_step = after_step
        self._idle_wait = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats = engine.stats()
        self.fatal_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run fn(engine) on the engine thread between steps; the future holds its result."""
        fut: Future[T] = Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine is not running"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def subscribe(self, group_id: str, sink: Sink) -> None:
        """Route every output of the request group to sink (called from any thread)."""
        self._sinks[group_id] = sink

    def unsubscribe(self, group_id: str) -> None:
        self._sinks.pop(group_id, None)

    def is_subscribed(self, group_id: str) -> bool:
        """Whether a live request group already streams under this id (any thread)."""
        return group_id in self._sinks

    def _busy(self) -> bool:
        sched = self.engine.scheduler
        return bool(sched.running or sched.waiting or sched.loading or sched.pinned)

    def busy(self) -> bool:
        """Any request running, queued, loading KV or holding pinned KV. Callable from any
        thread: it reads container sizes, enough to decide whether a drain is done."""
        return self._busy()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self._busy())
                outputs = self.engine.step()
                for out in outputs:
                    sink = self._sinks.get(out.group_id)
                    if sink is not None:
                        sink(out)
                if self._after_step is not None:
                    self._after_step(self.engine)
                self.stats = self.engine.stats()
                if not outputs and self._busy() and not self.engine.scheduler.running:
                    # Only waiting on the KV connector: poll without spinning a core.
                    self._drain_commands(block=True, timeout=0.002)
        except BaseException as exc:  # the worker reports unhealthy; nothing else can recover
            log.exception("engine thread died")
            self.fatal_error = exc
            while not self._commands.empty():
                _, fut = self._commands.get_nowait()
                fut.set_exception(RuntimeError("the engine thread died"))

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        wait = self._idle_wait if timeout is None else timeout
        try:
            item = self._commands.get(timeout=wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:  # delivered to the caller, e.g. a ValueError -> 400
                    fut.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
