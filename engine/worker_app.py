"""The worker process's HTTP service (prefill, decode or colocated): docs/internal-api.md.

create_app() builds a FastAPI app whose lifespan owns the engine thread, the KV connector, the KV
event publisher and the router registration. Handlers only validate, hand work to the engine
thread and stream its outputs back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.engine.config import EngineConfig, Role
from tandem.engine.engine import Engine, EngineOutput
from tandem.engine.engine_thread import EngineThread
from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.kv_events import KVEventPublisher
from tandem.engine.registration import Registrar
from tandem.engine.worker_metrics import worker_registry
from tandem.engine.worker_protocol import BadRequest, logprobs_to_wire, parse_generate_request

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    engine: EngineConfig
    role: Role
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # the address others reach us at (pod IP in Kubernetes)
    router_url: str | None = None
    kv_transport: str = "ucx"
    kv_lease_seconds: float = 10.0
    heartbeat_interval_s: float = 1.0


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    return JSONResponse(body, status_code=status)


class WorkerService:
    """Everything one worker process runs. Built inside the app's lifespan."""

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.role = config.role
        self.engine_id = uuid.uuid4().hex
        self.draining = False
        host = config.advertise_host or config.host
        self.url = f"http://{host}:{config.port}"
        self.model_name = config.engine.served_model_name or config.engine.model
        self.events = KVEventPublisher(self.engine_id, host=config.host)
        self.events_endpoint = self.events.endpoint.replace(config.host, host, 1)
        self.connector = None
        self.registry = worker_registry(
            lambda: self.thread.stats, self._counters, self.model_name, self.role.label
        )
        if self.role != Role.COLOCATED:
            self.connector = self._make_connector()
            engine.connector = self.connector
        self.thread = EngineThread(engine, after_step=self._after_step)

    def _make_connector(self) -> Any:
        from tandem.kvtransfer.factory import create_connector
        from tandem.kvtransfer.metrics import create_kv_transfer_metrics
        from tandem.kvtransfer.types import KVLayout

        kv_cache = self.engine.runner.kv_cache
        metrics = create_kv_transfer_metrics(self.registry, self.model_name, self.role.label)
        return create_connector(
            self.config.kv_transport,
            KVLayout.from_kv_cache(kv_cache),
            kv_cache,
            "prefill" if self.role == Role.PREFILL else "decode",
            host=self.config.host,
            advertise_host=self.config.advertise_host,
            lease_seconds=self.config.kv_lease_seconds,
            metrics=metrics,
        )

    def _counters(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.engine.num_prompt_tokens,
            "generation_tokens": self.engine.num_generation_tokens,
        }

    def _after_step(self, engine: Engine) -> None:
        self.events.publish(engine.take_kv_events())

    def info(self) -> dict[str, Any]:
        side = getattr(self.connector, "side_channel_address", None)
        return {
            "engine_id": self.engine_id,
            "role": self.role.label,
            "model": self.model_name,
            "url": self.url,
            "block_size": self.engine.kv_spec.block_size,
            "hash_algorithm": HASH_ALGORITHM,
            "max_model_len": self.engine.max_model_len,
            "num_blocks": self.engine.kv_spec.num_blocks,
            "kv_events_endpoint": self.events_endpoint,
            "kv_side_channel": side,
        }

    def load(self) -> dict[str, Any]:
        s = self.thread.stats
        return {
            "engine_id": self.engine_id,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "num_free_blocks": s.num_free_blocks,
        }

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.thread.stop()
        if self.connector is not None:
            self.connector.close()
        self.events.close()


def build_requests(engine: Engine, req: Any) -> list[Any]:
    """On the engine thread: build and queue the request(s); ValueError leaves nothing queued."""
    from tandem.decode.intake import attach_remote_kv
    from tandem.prefill.intake import mark_remote_decode

    reqs = engine.make_requests(
        req.request_id, req.prompt_token_ids, req.params, priority=req.priority
    )
    if req.kv_transfer_params is not None:
        attach_remote_kv(engine, reqs, req.kv_transfer_params)
    if req.remote_decode:
        mark_remote_decode(engine, reqs)
    for r in reqs:
        engine.enqueue(r)
    return reqs


def _chunk(out: EngineOutput) -> bytes:
    body = {
        "index": out.index,
        "token_ids": out.new_token_ids,
        "text": out.text_delta,
        "logprobs": [logprobs_to_wire(lp) for lp in out.logprobs] if out.logprobs else None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
        "error": {"message": out.error, "type": "server_error", "code": None}
        if out.error
        else None,
    }
    return json.dumps(body).encode() + b"\n"


def create_app(config: WorkerConfig, engine: Engine | None = None) -> FastAPI:
    """The worker app; the engine is built in the lifespan unless one is passed in (tests)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine or await asyncio.to_thread(Engine, config.engine)
        service = WorkerService(config, eng)
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
            await asyncio.wrap_future(s.thread.call(lambda e: build_requests(e, greq)))
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
                    yield _chunk(out)
            finally:
                s.thread.unsubscribe(greq.request_id)
                if remaining:  # the client went away: abort, so no block is left behind
                    s.thread.call(lambda e: e.abort([greq.request_id]))

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    return app
