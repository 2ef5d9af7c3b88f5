"""A server's start-up heap, frozen out of the garbage collector's full scans.

A worker or router process holds ~420k tracked objects once it has started (torch, the model,
FastAPI, the tokenizer). A full collection walks them all: 196-218 ms on this project's 2-core
VMs, a pause that every stream on the process waits through, at a time nobody chooses. They live
as long as the process, so once start-up is done they are collected once and moved to the
permanent generation (``gc.freeze``), as large Python services do; a full collection then walks
only what serving allocated (measured: ~0 ms right after). At shutdown ``gc.unfreeze`` hands them
back, so the interpreter's teardown frees them (native extensions report them leaked otherwise).

Applied by the ``tandem router|prefill|decode|colocated`` commands (``frozen_after_startup``),
not by ``create_app``: an app built in a test process must not freeze that process's heap.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol


class _HasLifespan(Protocol):
    lifespan_context: Callable[[Any], AbstractAsyncContextManager[Any]]


class _App(Protocol):
    router: _HasLifespan


def frozen_after_startup(app: _App) -> None:
    """Wrap ``app``'s lifespan (a FastAPI or Starlette app): once its start-up has run, collect
    and freeze the heap; when its shutdown begins, unfreeze it."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(asgi: Any) -> AsyncIterator[Any]:
        async with inner(asgi) as state:
            gc.collect()
            gc.freeze()
            try:
                yield state
            finally:
                gc.unfreeze()

    app.router.lifespan_context = lifespan
