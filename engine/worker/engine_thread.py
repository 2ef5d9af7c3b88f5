"""EngineThread: runs the engine's step loop on its own thread so request handling never stalls it.

Other threads (the worker's asyncio loop) only ever reach the engine through ``call``; outputs come
back through per-request sinks. With ``post`` (the loop's ``call_soon_threadsafe``) each step's
outputs cross to the loop in one hand-over and the sinks run there, so they may be plain
``Queue.put_nowait``; without it the sinks run on the engine thread and must be thread-safe. One
hand-over per step, not one per output: at 256 decoding sequences a ``call_soon_threadsafe``
per output cost the engine thread more than its whole step outside the model.

A failed step is contained by the engine itself (``engine/recovery.py``). If the thread dies
anyway (``EngineFailed``, or a failure outside the step), every subscribed stream gets one final
error output at once (``index`` -1: the whole request group ended), every pending and later
``call`` fails, and ``on_fatal`` tells the worker shell, which leaves the router, fails
``/health`` and exits non-zero.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
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
        on_fatal: Callable[[BaseException], None] | None = None,
        post: Callable[..., object] | None = None,
    ) -> None:
        self.engine = engine
        self._post = post
        self._after_step = after_step
        self._on_fatal = on_fatal
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
        self.wake()  # not left waiting out an idle wait
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
        if not self.alive:  # died between the check and the put: nobody will run it
            self._fail_pending()
        return fut

    def wake(self) -> None:
        """Any thread: end the engine thread's wait for commands now (its idle wait, or its
        poll while only the KV connector has work), so it steps again at once. Called by the
        KV connector when a load ends or blocks are released; costs one queue put."""
        self._commands.put((_nothing, Future()))

    def subscribe(self, group_id: str, sink: Sink) -> None:
        """Route every output of the request group to sink (called from any thread; the sink
        runs where ``post`` runs the step's hand-over, else on the engine thread)."""
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
                if outputs:
                    self._hand_over(outputs)
                if self._after_step is not None:
                    self._after_step(self.engine)
                self.stats = self.engine.stats()
                if not outputs and self._busy() and not self.engine.scheduler.running:
                    # Only waiting on the KV connector: poll without spinning a core.
                    self._drain_commands(block=True, timeout=0.002)
        except BaseException as exc:  # the worker reports unhealthy; nothing else can recover
            log.critical("engine thread died", exc_info=exc)
            self.fatal_error = exc
            self._end_streams(f"the engine thread died: {type(exc).__name__}: {exc}")
            self._fail_pending()
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _hand_over(self, outputs: Sequence[EngineOutput]) -> None:
        if self._post is None:
            self._deliver(outputs)
        else:
            self._post(self._deliver, outputs)

    def _deliver(self, outputs: Sequence[EngineOutput]) -> None:
        """Each output to its group's sink (where ``post`` runs this: the loop, if given)."""
        sinks = self._sinks
        for out in outputs:
            sink = sinks.get(out.group_id)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # noqa: BLE001 - every other stream must still get its own
                    log.exception("delivering to stream %s failed", out.group_id)

    def _end_streams(self, message: str) -> None:
        try:
            self._hand_over([fatal_output(group_id, message) for group_id in list(self._sinks)])
        except Exception:  # noqa: BLE001 - e.g. the loop closed: pending calls and on_fatal remain
            log.exception("ending the streams failed")

    def _fail_pending(self) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
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


def _nothing(engine: Engine) -> None:
    """The command ``wake`` queues: draining it is the point."""


def fatal_output(group_id: str, message: str) -> EngineOutput:
    """The one output a stream gets when the engine thread dies: the whole group ended."""
    return EngineOutput(
        request_id=group_id,
        group_id=group_id,
        index=-1,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error=message,
    )
