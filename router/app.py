"""The router's FastAPI app: OpenAI endpoints, worker registration, health and metrics.

``create_app(config)`` builds it; its lifespan owns the tokenizer, the aiohttp session to workers,
the KV-event subscriber and the expiry task, and closes them on shutdown. Handlers stay thin:
parsing and validation live in ``protocol``, request serving in ``serving``, orchestration in
``flow``, formatting in ``sse``.

``/health`` answers 200 whenever the router itself serves, with worker counts in the body: in
Kubernetes workers register through the router's Service, which only routes to ready pods, so
readiness must not wait for workers. The workers' registration API is not on this app: it is
``internal_app.create_internal_app``, served on its own listener (``--internal-port``) behind the
cluster token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.model_path import resolve_model_path
from tandem.engine.role import Role
from tandem.router.errors import OpenAIError
from tandem.router.metrics import RouterMetrics
from tandem.router.serving import handle_generation
from tandem.router.sse import Kind
from tandem.router.state import RouterConfig, RouterState, model_context_limit
from tandem.router.tokenizer import PromptEncoder
from tandem.router.worker_client import MAX_LINE_BYTES

__all__ = ["RouterConfig", "create_app"]

log = logging.getLogger(__name__)


def create_app(
    config: RouterConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    encoder: PromptEncoder | None = None,
) -> FastAPI:
    """Build the router app. ``encoder`` overrides loading the tokenizer from the model path."""
    metrics = RouterMetrics(config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        enc = encoder
        if enc is None:
            path = (
                Path(config.model_path) if config.model_path else resolve_model_path(config.model)
            )
            enc = await asyncio.to_thread(PromptEncoder.load, path)
        t = config.timeouts
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_read=t.read_s),
            read_bufsize=MAX_LINE_BYTES,
            raise_for_status=False,
        )
        max_context = await asyncio.to_thread(model_context_limit, config)
        async with session as http:
            state = RouterState(config, metrics, enc, http, clock, max_context)
            app.state.router = state
            expiry = asyncio.create_task(_expire_loop(state, config.expiry_interval_s))
            try:
                yield
            finally:
                expiry.cancel()
                await asyncio.gather(expiry, return_exceptions=True)
                await state.subscriber.close()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.router_config = config

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    def st(request: Request) -> RouterState:
        return request.app.state.router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_generation(st(request), request, Kind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_generation(st(request), request, Kind.CHAT)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        s = st(request)
        try:
            s.check_auth(request)
        except OpenAIError as exc:
            s.metrics.request("/v1/models", exc.status)
            return exc.response()
        s.metrics.request("/v1/models", 200)
        card = {
            "id": config.model,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            # The tokenizer directory, as vLLM's card names its model path: `tandem bench` (and
            # any benchmark client) loads the same tokenizer from it.
            "root": config.model_path or config.model,
            "max_model_len": s.registry.max_model_len(),
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(request: Request) -> Response:
        s = st(request)
        counts = {role.label: len(s.registry.by_role(role)) for role in Role}
        return JSONResponse({"status": "ok", "workers": counts})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _expire_loop(state: RouterState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.expire()
