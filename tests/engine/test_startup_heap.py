"""engine/startup_heap.py: the heap is frozen once an app's start-up has run, for as long as it
serves, and handed back when its shutdown begins."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tandem.engine.startup_heap import frozen_after_startup


def test_the_heap_is_frozen_while_the_app_serves_and_thawed_at_shutdown() -> None:
    seen: dict[str, int] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        seen["during_startup"] = gc.get_freeze_count()  # start-up runs before the freeze
        yield
        seen["during_shutdown"] = gc.get_freeze_count()  # thawed before the app's own teardown

    app = FastAPI(lifespan=lifespan)

    @app.get("/frozen")
    def frozen() -> dict[str, int]:
        return {"count": gc.get_freeze_count()}

    frozen_after_startup(app)
    assert gc.get_freeze_count() == 0
    with TestClient(app) as client:
        assert client.get("/frozen").json()["count"] > 1000
    assert seen == {"during_startup": 0, "during_shutdown": 0}
    assert gc.get_freeze_count() == 0
