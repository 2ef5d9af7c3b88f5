"""The worker process's HTTP service (prefill, decode or colocated): docs/internal-api.md.

create_app(config, role) builds a FastAPI app whose lifespan owns the WorkerService (engine
thread, the role's connector, KV event publisher) and the router registration. Handlers only
validate, hand work to the engine thread and stream its outputs back.

If the engine thread dies, every open stream has already ended with an error chunk (the engine
thread does that); the app then stops serving: ``/health`` fails, the worker deregisters from
the router, ``app.state.engine_failed`` is set and ``app.state.shutdown`` (installed by the CLI)
stops the server, whose exit status is then non-zero.

``/info`` and ``/v1/internal/*`` require the cluster token (``config.cluster_token``; the CLI
always has one); ``/health`` and ``/metrics`` stay open for probes and Prometheus. Bodies are
read under a cap and requests are re-checked against the router's limits (defence in depth).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from tandem.engine import http_body
from tandem.engine.builder import build_engine_parts
from tandem.engine.engine import Engine
from tandem.engine.internal_auth import ClusterAuth
from tandem.engine.outputs import EngineOutput
from tandem.engine.request_limits import MAX_CONTROL_BYTES, MAX_INTERNAL_REQUEST_BYTES
from tandem.engine.sim.builder import build_simulated_parts
from tandem.engine.worker.protocol import (
    BadRequest,
    QueueFull,
    encode_chunk,
    parse_generate_request,
    parse_grant_request,
)
from tandem.engine.worker.role import WorkerRole
from tandem.engine.worker.router_set import RouterSet
from tandem.engine.worker.service import WorkerConfig, WorkerService

__all__ = ["WorkerConfig", "create_app"]

log = logging.getLogger(__name__)


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }
    return JSONResponse(body, status_code=status)


def _unavailable(message: str, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "unavailable", "param": None, "code": code}}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


def is_internal(path: str) -> bool:
    """The routes behind the cluster token."""
    return path == "/info" or path.startswith("/v1/internal/")


async def _json_body(request: Request, max_bytes: int) -> Any:
    """The parsed body; raises _BodyError (a ready response) when too big or not JSON."""
    try:
        raw = await http_body.read_capped(
            request.stream(), request.headers.get("content-length"), max_bytes
        )
    except http_body.BodyTooLarge as exc:
        raise _BodyError(_error(413, str(exc), code="request_too_large")) from None
    except http_body.BadContentLength as exc:
        raise _BodyError(_error(400, str(exc))) from None
    except ClientDisconnect:
        raise _BodyError(_error(499, "the client disconnected while sending")) from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _BodyError(_error(400, "body must be JSON")) from None


class _BodyError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def create_app(config: WorkerConfig, role: WorkerRole) -> FastAPI:
    """The worker app of ``role``; the engine is built in the lifespan, off the event loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def on_fatal(exc: BaseException) -> None:  # on the engine thread, as it dies
            loop.call_soon_threadsafe(lambda: loop.create_task(_engine_died(app)))

        def build() -> WorkerService:
            if config.simulate is not None:
                parts = build_simulated_parts(config.engine, config.simulate)
            else:
                parts = build_engine_parts(config.engine)
            # Each step's outputs reach the streams' queues in one hand-over to this loop.
            return WorkerService(config, role, parts, on_fatal, post=loop.call_soon_threadsafe)

        service = await asyncio.to_thread(build)
        service.start()
        app.state.service = service
        registrar = None
        urls = config.router_urls or ((config.router_url,) if config.router_url else ())
        if urls:
            # Every router replica: each URL's every address, re-resolved as routers come and go.
            registrar = RouterSet(
                urls,
                service.info,
                service.load,
                config.heartbeat_interval_s,
                token=config.cluster_token,
                resolve_interval_s=config.router_resolve_interval_s,
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
    app.state.engine_failed = False
    app.state.shutdown = None
    app.add_middleware(ClusterAuth, token=config.cluster_token, protects=is_internal)

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
                "host_block_hashes": [h.hex() for h in e.cached_host_hashes()],
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
            body = await _json_body(request, MAX_CONTROL_BYTES)
        except _BodyError as exc:
            return exc.response
        rid = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return _error(400, "request_id must be a string", "request_id")
        done = await asyncio.wrap_future(s.thread.call(lambda e: e.abort([rid])))
        return JSONResponse({"aborted": bool(done)})

    @app.post("/v1/internal/kv_grant")
    async def kv_grant(request: Request) -> Response:
        """A peer's prefix pull (decode/peer.py): pin and publish this worker's cached blocks of
        the prefix; 404 ``no_prefix`` when none is cached, 400 when the role serves none."""
        s = svc(request)
        if s.draining or not s.thread.alive:
            return _unavailable("worker is draining" if s.thread.alive else "engine not running")
        try:
            rid, token_ids = parse_grant_request(
                await _json_body(request, MAX_INTERNAL_REQUEST_BYTES)
            )
            grant = await asyncio.wrap_future(
                s.thread.call(lambda e: s.role.grant(e, rid, token_ids))
            )
        except _BodyError as exc:
            return exc.response
        except BadRequest as exc:
            return _error(400, str(exc), exc.param)
        except RuntimeError as exc:
            return _unavailable(str(exc), "engine_dead")
        if grant is None:
            return _error(404, "no block of this prefix is cached here", None, "no_prefix")
        return JSONResponse({"kv_transfer_params": grant})

    @app.get("/v1/internal/integrity")
    async def integrity(request: Request) -> Response:
        """The engine's accounting and whether it is consistent (the chaos suite's end-of-run
        check: an idle worker holds no block and no request)."""
        s = svc(request)

        def check(e: Engine) -> dict[str, Any]:
            try:
                e.check_integrity()
                error = None
            except AssertionError as exc:
                error = str(exc)
            acct = e.accounting()
            return {"engine_id": s.engine_id, "ok": error is None, "error": error,
                    "idle": acct.idle, **acct.to_dict()}  # fmt: skip

        try:
            return JSONResponse(await asyncio.wrap_future(s.thread.call(check)))
        except RuntimeError as exc:
            return _unavailable(str(exc), "engine_dead")

    @app.post("/v1/internal/generate")
    async def generate(request: Request) -> Response:
        arrival = time.monotonic()  # the worker's latency histograms count from here
        s = svc(request)
        if s.draining or not s.thread.alive:
            return _unavailable(
                "worker is draining" if s.thread.alive else "the engine is not running"
            )
        try:
            body = await _json_body(request, MAX_INTERNAL_REQUEST_BYTES)
        except _BodyError as exc:
            return exc.response
        try:
            greq = parse_generate_request(body)
        except BadRequest as exc:
            return _error(400, str(exc), exc.param)
        if s.thread.is_subscribed(greq.request_id):
            # Never let a second request take over a live one's output stream.
            return _error(
                409, f"request_id {greq.request_id!r} is already in use", "request_id", "conflict"
            )
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        s.thread.subscribe(greq.request_id, queue.put_nowait)  # run on this loop (post)
        try:
            await asyncio.wrap_future(s.thread.call(lambda e: s.submit(greq, arrival)))
        except BadRequest as exc:
            s.thread.unsubscribe(greq.request_id)
            return _error(400, str(exc), exc.param)
        except ValueError as exc:
            s.thread.unsubscribe(greq.request_id)
            msg = str(exc)
            param = "prompt_token_ids" if "prompt" in msg else None
            return _error(400, msg, param)
        except QueueFull as exc:
            s.thread.unsubscribe(greq.request_id)
            return _unavailable(str(exc), "queue_full")
        except RuntimeError as exc:  # the engine thread died
            s.thread.unsubscribe(greq.request_id)
            return _unavailable(str(exc), "engine_dead")

        async def stream() -> AsyncIterator[bytes]:
            remaining = greq.params.n
            try:
                while remaining:
                    out = await queue.get()
                    if out.index < 0:  # the engine thread died: the whole group ended
                        remaining = 0
                        yield encode_chunk(replace(out, index=0))
                        break
                    if out.finished:
                        remaining -= 1
                        s.latency.observe(out.timings)
                    yield encode_chunk(out)
            finally:
                s.thread.unsubscribe(greq.request_id)
                if remaining:  # the client went away: abort, so no block is left behind
                    s.thread.call(lambda e: e.abort([greq.request_id]))

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    return app


async def _engine_died(app: FastAPI) -> None:
    """The engine thread died (its streams have ended): stop taking work, leave the router,
    then stop the server so the process exits non-zero and its supervisor restarts it."""
    service: WorkerService = app.state.service
    service.draining = True
    app.state.engine_failed = True
    log.critical("the engine thread died; leaving the router and exiting")
    registrar = app.state.registrar
    if registrar is not None:
        await registrar.stop()
    if app.state.shutdown is not None:
        app.state.shutdown()
