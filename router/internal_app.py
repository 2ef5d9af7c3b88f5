"""The router's internal listener: the workers' registry API, behind the cluster token.

``create_internal_app(public)`` builds a second FastAPI app that shares the public app's
``RouterState`` (its lifespan owns the state; this app has none), served on ``--internal-port``
(``router/cli.py`` runs both listeners in one process). Every route requires
``Authorization: Bearer <cluster token>`` when the router has one (``tandem router`` always
does; an in-process app built without a token, as unit tests do, is open). Bodies are read
under a cap. Routes and bodies: docs/internal-api.md "Registration".
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.internal_auth import ClusterAuth
from tandem.engine.request_limits import MAX_CONTROL_BYTES
from tandem.router.body import read_capped
from tandem.router.errors import OpenAIError, bad_request
from tandem.router.protocol import parse_body
from tandem.router.registry import Heartbeat, WorkerInfo
from tandem.router.state import RouterState

log = logging.getLogger(__name__)
MAX_REGISTRATION_BYTES = MAX_CONTROL_BYTES


def create_internal_app(public: FastAPI) -> FastAPI:
    """The registry app over ``public``'s state; serve it only on the internal listener."""
    app = FastAPI(title="Tandem router (internal)", openapi_url=None, docs_url=None,
                  redoc_url=None)  # fmt: skip

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    def st() -> RouterState:
        state = getattr(public.state, "router", None)
        if state is None:
            raise OpenAIError(503, "the router is starting", code="starting")
        return state

    async def body(request: Request) -> dict:
        return parse_body(await read_capped(request, MAX_REGISTRATION_BYTES),
                          MAX_REGISTRATION_BYTES)  # fmt: skip

    @app.post("/internal/workers/register")
    async def register(request: Request) -> Response:
        s = st()
        info = WorkerInfo.from_json(await body(request))
        s.register(info)
        log.info("registered %s worker %s at %s", info.role.label, info.engine_id, info.url)
        return JSONResponse({"registered": True,
                             "heartbeat_timeout_s": s.config.heartbeat_timeout_s})  # fmt: skip

    @app.post("/internal/workers/heartbeat")
    async def heartbeat(request: Request) -> Response:
        s = st()
        hb = Heartbeat.from_json(await body(request))
        if not s.registry.heartbeat(hb):
            return OpenAIError(
                404, "unknown engine_id: register again", code="unknown_worker"
            ).response()
        return JSONResponse({"ok": True})

    @app.post("/internal/workers/deregister")
    async def deregister(request: Request) -> Response:
        s = st()
        engine_id = (await body(request)).get("engine_id")
        if not isinstance(engine_id, str):
            raise bad_request("engine_id must be a string", "engine_id")
        return JSONResponse({"deregistered": s.deregister(engine_id)})

    @app.get("/internal/workers")
    async def list_workers(request: Request) -> Response:
        return JSONResponse({"workers": [w.describe() for w in st().registry.all()]})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    app.add_middleware(ClusterAuth, token=public.state.router_config.cluster_token)
    return app
