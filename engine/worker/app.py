"""The worker process's HTTP service (prefill, decode or colocated): docs/internal-api.md.

create_app(config, role) builds a FastAPI app whose lifespan owns the WorkerService (engine
thread, the role's connector, KV event publisher) and the router registration. Handlers only
validate, hand work to the engine thread and stream its outputs back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.engine.builder import build_engine_parts
from tandem.engine.engine import Engine
from tandem.engine.outputs import EngineOutput
from tandem.engine.sim.builder import build_simulated_parts
from tandem.engine.worker.protocol import BadRequest, encode_chunk, parse_generate_request
from tandem.engine.worker.registration import Registrar
from tandem.engine.worker.role import WorkerRole
from tandem.engine.worker.service import WorkerConfig, WorkerService

__all__ = ["WorkerConfig", "create_app"]

log = logging.getLogger(__name__)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    return JSONResponse(body, status_code=status)


def create_app(config: WorkerConfig, role: WorkerRole) -> FastAPI:
    """The worker app of ``role``; the engine is built in the lifespan, off the event loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        def build() -> WorkerService:
            if config.simulate is not None:
                parts = build_simulated_parts(config.engine, config.simulate)
            else:
                parts = build_engine_parts(config.engine)
            return WorkerService(config, role, parts)

        service = await asyncio.to_thread(build)
        service.start()
        app.state.service = service
        registrar = None
        if config.router_url:
            registrar = Registrar(
                config.router_url, service.info, service.load, config.heartbeat_interval_s
            )
            registrar.start()
        app.state.registrar = registrar
        try:
            yield
        finally:
            service.draining = True
            if registrar is not None:
                await registrar.stop()
            await asyncio.to_thread(service.close)

    app = FastAPI(title="tandem worker", lifespan=lifespan)

    def svc(request: Request) -> WorkerService:
        return request.app.state.service

    @app.get("/health")
    async def health(request: Request) -> Response:
        s = svc(request)
        if s.draining or not s.thread.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        return svc(request).info()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(svc(request).registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/internal/kv_blocks")
    async def kv_blocks(request: Request) -> dict[str, Any]:
        s = svc(request)

        def snapshot(e: Engine) -> dict[str, Any]:
            # Taken on the engine thread, so seq and the hash set are consistent.
            return {
                "engine_id": s.engine_id,
                "seq": s.events.seq,
                "block_hashes": [h.hex() for h in e.pool.cached_hashes()],
            }

        return await asyncio.wrap_future(s.thread.call(snapshot))

    @app.api_route("/v1/internal/drain", methods=["GET", "POST"])
    async def drain(request: Request, timeout: float = 50.0) -> Response:
        """Scale-down (Kubernetes preStop): leave the router's registry, refuse new work, and
        return once in-flight requests are done (and a prefill's pinned KV is pulled or its
        lease expired), or after ``timeout`` seconds."""
        s = svc(request)
        s.draining = True
        registrar = request.app.state.registrar
        if registrar is not None:
            await registrar.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(timeout, 3600.0))
        while s.thread.busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return JSONResponse({"drained": not s.thread.busy(), "engine_id": s.engine_id})

    @app.post("/v1/internal/abort")
    async def abort(request: Request) -> Response:
        s = svc(request)
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be JSON")
        rid = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return _error(400, "request_id must be a string", "request_id")
        done = await asyncio.wrap_future(s.thread.call(lambda e: e.abort([rid])))
        return JSONResponse({"aborted": bool(done)})

    @app.post("/v1/internal/generate")
    async def generate(request: Request) -> Response:
        s = svc(request)
        if s.draining:
            return JSONResponse(
                {
                    "error": {
                        "message": "worker is draining",
                        "type": "unavailable",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=503,
            )
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be JSON")
        try:
            greq = parse_generate_request(body)
        except BadRequest as exc:
            return _error(400, str(exc), exc.param)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        s.thread.subscribe(
            greq.request_id, lambda o: loop.call_soon_threadsafe(queue.put_nowait, o)
        )
        try:
            await asyncio.wrap_future(s.thread.call(lambda e: s.submit(greq)))
        except BadRequest as exc:
            s.thread.unsubscribe(greq.request_id)
            return _error(400, str(exc), exc.param)
        except ValueError as exc:
            s.thread.unsubscribe(greq.request_id)
            msg = str(exc)
            param = "prompt_token_ids" if "prompt" in msg else None
            return _error(400, msg, param)

        async def stream() -> AsyncIterator[bytes]:
            remaining = greq.params.n
            try:
                while remaining:
                    out = await queue.get()
                    if out.finished:
                        remaining -= 1
                    yield encode_chunk(out)
            finally:
                s.thread.unsubscribe(greq.request_id)
                if remaining:  # the client went away: abort, so no block is left behind
                    s.thread.call(lambda e: e.abort([greq.request_id]))

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    return app
