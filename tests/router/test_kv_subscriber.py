"""The router's KV-event subscriber shuts down cleanly however its subscriptions ended."""

from __future__ import annotations

import asyncio
import threading
import time

from tandem.router.kv_events import KvEventSubscriber
from tandem.router.prefix_index import PrefixIndex


def _closes_within(seconds: float, scenario) -> bool:  # noqa: ANN001 - an async callable
    """Run ``scenario`` on its own event loop in a thread: a blocked loop (a ZMQ context
    waiting for sockets nobody can close) cannot be interrupted from inside it."""
    done = threading.Event()

    def run() -> None:
        asyncio.run(scenario())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


def test_closing_right_after_a_worker_left_does_not_hang() -> None:
    # A worker leaves (stop) and the router shuts down (close) before the cancelled
    # subscription has run again: its SUB and monitor sockets are still open. close() must
    # wait for them; ending the ZMQ context first blocked the event loop for good.
    async def scenario() -> None:
        sub = KvEventSubscriber(PrefixIndex(time.monotonic), client=None, connect_wait_s=5.0)  # type: ignore[arg-type]
        # Nothing listens there: the task opens its socket and waits for a handshake.
        sub.start("w0", "tcp://127.0.0.1:9", "http://127.0.0.1:9")
        await asyncio.sleep(0.05)
        sub.stop("w0")
        await sub.close()

    assert _closes_within(10.0, scenario), "KvEventSubscriber.close() hung"


def test_closing_with_live_and_restarted_subscriptions() -> None:
    # A worker that re-registers restarts its subscription (the old task is stopped); another
    # is live. Both end, and the context with them.
    async def scenario() -> None:
        sub = KvEventSubscriber(PrefixIndex(time.monotonic), client=None, connect_wait_s=5.0)  # type: ignore[arg-type]
        sub.start("w0", "tcp://127.0.0.1:9", "http://127.0.0.1:9")
        sub.start("w1", "tcp://127.0.0.1:9", "http://127.0.0.1:9")
        await asyncio.sleep(0.05)
        sub.start("w0", "tcp://127.0.0.1:9", "http://127.0.0.1:9")
        await sub.close()
        assert sub._ctx.closed

    assert _closes_within(10.0, scenario), "KvEventSubscriber.close() hung"
