"""The router's FastAPI app: OpenAI endpoints, worker registration, health and metrics.

``create_app(config)`` builds it; its lifespan owns the tokenizer, the HTTP client to workers, the
KV-event subscriber and the expiry task, and closes them on shutdown. Handlers stay thin: parsing
and validation live in ``protocol``, orchestration in ``flow``, formatting in ``sse``.

``/health`` answers 200 whenever the router itself serves, with worker counts in the body: in
Kubernetes workers register through the router's Service, which only routes to ready pods, so
readiness must not wait for workers. ``/internal/workers/*`` is the workers' registration API
(docs/internal-api.md); it is not behind the API key, so keep it off public ingress.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.hashing import HASH_ALGORITHM
from tandem.router.errors import OpenAIError, bad_request, no_workers
from tandem.router.flow import (
    ChoiceFailed,
    ChoiceJob,
    FlowConfig,
    FlowContext,
    TokenEvent,
    stream_choices,
)
from tandem.router.kv_events import KvEventSubscriber
from tandem.router.metrics import RouterMetrics
from tandem.router.placement import Placer, Policy
from tandem.router.prefix_index import ApplyResult, PrefixIndex
from tandem.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    validate,
)
from tandem.router.registry import Heartbeat, Role, WorkerInfo, WorkerRegistry, WorkerState
from tandem.router.sse import Kind, ResponseBuilder
from tandem.router.tokenizer import PromptEncoder, resolve_model_path
from tandem.router.worker_client import Timeouts, WorkerClient

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class RouterConfig:
    model: str = "demo"  # served name, exactly as given to --model; workers must report the same
    model_path: str | None = None  # tokenizer directory; None resolves ``model``
    policy: Policy = Policy.PREFIX_AWARE
    local_prefill_threshold: int = 0
    api_keys: tuple[str, ...] = ()
    heartbeat_timeout_s: float = 3.0
    expiry_interval_s: float = 0.5
    events_stale_after_s: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    poll_s: float = 0.25


class RouterState:
    """Per-app state built by the lifespan; handlers reach it through ``app.state.router``."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        encoder: PromptEncoder,
        http: httpx.AsyncClient,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.encoder = encoder
        self.registry = WorkerRegistry(clock, config.heartbeat_timeout_s, model=config.model)
        self.index = PrefixIndex(clock, config.events_stale_after_s)
        self.client = WorkerClient(http, config.timeouts)
        self.subscriber = KvEventSubscriber(self.index, self.client, self._on_event)
        self.flow = FlowContext(
            registry=self.registry,
            index=self.index,
            placer=Placer(config.policy),
            client=self.client,
            metrics=metrics,
            config=FlowConfig(
                local_prefill_threshold=config.local_prefill_threshold,
                poll_s=config.poll_s,
                read_timeout_s=config.timeouts.read_s,
            ),
        )

    def _on_event(self, engine_id: str, result: ApplyResult) -> None:
        if result is ApplyResult.NEEDS_RESYNC:
            self.metrics.kv_resyncs.labels(self.metrics.model).inc()

    # -- registry ---------------------------------------------------------------------------
    def register(self, info: WorkerInfo) -> None:
        for old in self.registry.register(info):
            self._forget(old)
        if info.hash_algorithm != HASH_ALGORITHM:
            log.warning(
                "worker %s hashes with %s, router with %s: scored by load only",
                info.engine_id, info.hash_algorithm, HASH_ALGORITHM,
            )  # fmt: skip
        if info.kv_events_endpoint and not self.index.is_synced(info.engine_id):
            self.index.add_worker(info.engine_id, info.num_blocks)
            self.subscriber.start(info.engine_id, info.kv_events_endpoint, info.url)
        self._update_gauges()

    def _forget(self, w: WorkerState) -> None:
        self.subscriber.stop(w.info.engine_id)
        self.index.remove_worker(w.info.engine_id)

    def deregister(self, engine_id: str) -> bool:
        w = self.registry.deregister(engine_id)
        if w is not None:
            self._forget(w)
        self._update_gauges()
        return w is not None

    def expire(self) -> None:
        for w in self.registry.expire():
            log.warning("worker %s (%s) stopped heartbeating", w.info.engine_id, w.info.url)
            self._forget(w)
        self._update_gauges()

    def _update_gauges(self) -> None:
        for role in Role:
            n = len(self.registry.by_role(role))
            self.metrics.workers.labels(self.metrics.model, role.label).set(n)

    # -- requests ---------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), k.encode()) for k in self.config.api_keys
        )
        if not ok:
            raise OpenAIError(
                401,
                "Incorrect API key provided." if header else "No API key provided.",
                type="invalid_request_error",
                code="invalid_api_key",
            )


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
        timeout = httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.control_s, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            state = RouterState(config, metrics, enc, http, clock)
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
        return await _handle(st(request), request, Kind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(st(request), request, Kind.CHAT)

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

    @app.post("/internal/workers/register")
    async def register(request: Request) -> Response:
        s = st(request)
        info = WorkerInfo.from_json(parse_body(await request.body(), 1024 * 1024))
        s.register(info)
        log.info("registered %s worker %s at %s", info.role.label, info.engine_id, info.url)
        return JSONResponse({"registered": True, "heartbeat_timeout_s": config.heartbeat_timeout_s})

    @app.post("/internal/workers/heartbeat")
    async def heartbeat(request: Request) -> Response:
        hb = Heartbeat.from_json(parse_body(await request.body(), 64 * 1024))
        if not st(request).registry.heartbeat(hb):
            return OpenAIError(
                404, "unknown engine_id: register again", code="unknown_worker"
            ).response()
        return JSONResponse({"ok": True})

    @app.post("/internal/workers/deregister")
    async def deregister(request: Request) -> Response:
        body = parse_body(await request.body(), 64 * 1024)
        engine_id = body.get("engine_id")
        if not isinstance(engine_id, str):
            raise bad_request("engine_id must be a string", "engine_id")
        return JSONResponse({"deregistered": st(request).deregister(engine_id)})

    @app.get("/internal/workers")
    async def list_workers(request: Request) -> Response:
        return JSONResponse({"workers": [w.describe() for w in st(request).registry.all()]})

    return app


async def _expire_loop(state: RouterState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.expire()


async def _handle(s: RouterState, request: Request, kind: Kind) -> Response:
    route = request.url.path
    arrival = time.monotonic()
    try:
        s.check_auth(request)
        body = parse_body(await request.body(), s.config.max_body_bytes)
        req: ChatCompletionRequest | CompletionRequest
        if kind is Kind.CHAT:
            req = validate(ChatCompletionRequest, body)
        else:
            req = validate(CompletionRequest, body)
        if req.model != s.config.model:
            raise OpenAIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{s.config.model}'.",
                param="model",
                code="model_not_found",
            )
        request_id = ("chatcmpl-" if kind is Kind.CHAT else "cmpl-") + uuid.uuid4().hex
        jobs, prompt_tokens = _make_jobs(s, req, request_id)
        s.metrics.prompt_tokens.labels(s.metrics.model).inc(prompt_tokens)
        builder = ResponseBuilder(
            kind,
            request_id,
            s.config.model,
            len(jobs),
            prompt_tokens,
            s.encoder,
            logprobs=_engine_logprobs(req) is not None,
            include_usage=req.include_usage,
        )
        timing = _Timing(s.metrics, arrival, len(jobs))
        events = stream_choices(s.flow, jobs)
        if req.stream:
            first = await _until_disconnect(request, anext(events, None), events)
            s.metrics.request(route, 200)
            return StreamingResponse(
                _sse_body(builder, events, first, timing),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        await _until_disconnect(request, _collect(builder, events, timing), events)
        s.metrics.request(route, 200)
        return JSONResponse(builder.response())
    except OpenAIError as exc:
        s.metrics.request(route, exc.status)
        return exc.response()
    except ChoiceFailed as exc:
        s.metrics.request(route, 502)
        return OpenAIError(502, str(exc), code="worker_failed").response()
    except _Disconnected:
        s.metrics.request(route, 499)
        return Response(status_code=499)


def _engine_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.engine_logprobs()
    return req.logprobs


def _make_jobs(
    s: RouterState, req: ChatCompletionRequest | CompletionRequest, request_id: str
) -> tuple[list[ChoiceJob], int]:
    """Tokenize each prompt once, check it against the context length, and fan out n choices."""
    max_len = s.registry.max_model_len()
    if max_len is None or not s.registry.by_role(Role.DECODE, Role.COLOCATED):
        raise no_workers("decode")
    if isinstance(req, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompts = [s.encoder.encode_chat(messages, req.add_generation_prompt,
                                         req.chat_template_kwargs)]  # fmt: skip
        requested, param = req.requested_max_tokens(), "messages"
    else:
        prompts = [s.encoder.encode_text(p) if isinstance(p, str) else p for p in req.prompts()]
        requested, param = req.max_tokens, "prompt"
    vocab = s.encoder.vocab_size()
    jobs: list[ChoiceJob] = []
    total_prompt = 0
    for ids in prompts:
        if not ids:
            raise bad_request("The prompt is empty after tokenization.", param)
        if max(ids) >= vocab:
            raise bad_request(f"Token id {max(ids)} is out of vocabulary (size {vocab}).", param)
        if len(ids) + (requested or 1) > max_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(ids) + (requested or 0)} tokens ({len(ids)} in the {param}, "
                f"{requested or 0} in the completion). Please reduce the length of the {param} "
                "or completion.",
                param=param,
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else max_len - len(ids)
        total_prompt += len(ids)
        for j in range(req.n):
            sampling = req.to_sampling_dict(max_tokens, _engine_logprobs(req))
            if req.seed is not None:
                sampling["seed"] = req.seed + j
            jobs.append(ChoiceJob(request_id, len(jobs), ids, sampling))
    return jobs, total_prompt


class _Disconnected(Exception):
    pass


async def _until_disconnect(request: Request, work: Awaitable[T], events: Any) -> T:
    """Await ``work`` unless the client goes away first (then the flow is closed: aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.aclose()
        raise _Disconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(
    builder: ResponseBuilder, events: AsyncIterator[TokenEvent], timing: Any
) -> None:
    try:
        async for ev in events:
            timing.on_event(ev)
            _absorb(builder, ev)
    finally:
        timing.finish()


def _absorb(builder: ResponseBuilder, ev: TokenEvent) -> None:
    if ev.num_cached_tokens and builder.choices[ev.choice].num_tokens == 0:
        builder.cached_tokens = max(builder.cached_tokens, ev.num_cached_tokens)
    builder.absorb(ev)


async def _sse_body(
    builder: ResponseBuilder,
    events: AsyncIterator[TokenEvent],
    first: TokenEvent | None,
    timing: _Timing,
) -> AsyncIterator[bytes]:
    try:
        for chunk in builder.start_chunks():
            yield chunk
        ev = first
        while ev is not None:
            timing.on_event(ev)
            _absorb(builder, ev)
            for chunk in builder.event_chunks(ev):
                yield chunk
            ev = await anext(events, None)
        for chunk in builder.end_chunks():
            yield chunk
    except OpenAIError as exc:
        for chunk in builder.error_chunks(exc):
            yield chunk
    except ChoiceFailed as exc:
        for chunk in builder.error_chunks(OpenAIError(502, str(exc), code="worker_failed")):
            yield chunk
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        timing.finish()


class _Timing:
    """TTFT, ITL and end-to-end latency of one request.

    In P->D mode TTFT is taken at the first token from decode (covering prefill, KV transfer and
    the first decode step), although prefill's token already reached the client; ITL then measures
    decode steps only. TTFT is observed once per request, at its first choice to get there.
    """

    def __init__(self, metrics: RouterMetrics, arrival: float, num_choices: int) -> None:
        self._m = metrics
        self._arrival = arrival
        self._ttft_done = False
        self._last: list[float | None] = [None] * num_choices
        self._tokens = 0
        self._done = False

    def on_event(self, ev: TokenEvent) -> None:
        n = len(ev.token_ids)
        self._tokens += n
        if n == 0 and ev.finish_reason is None:
            return
        if ev.handoff:
            return  # wait for decode's first token
        now = time.monotonic()
        model = self._m.model
        prev = self._last[ev.choice]
        if prev is None:
            if not self._ttft_done:
                self._ttft_done = True
                self._m.ttft.labels(model).observe(now - self._arrival)
            n_itl = n - 1  # the first token of a choice has no inter-token gap before it
        else:
            n_itl = n
        if prev is not None and n_itl > 0:
            for _ in range(n_itl):
                self._m.itl.labels(model).observe((now - prev) / n_itl)
        if n:
            self._last[ev.choice] = now

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        model = self._m.model
        if self._tokens:  # requests that failed before any output are not latency samples
            self._m.e2e.labels(model).observe(time.monotonic() - self._arrival)
        self._m.generation_tokens.labels(model).inc(self._tokens)
