"""Serving one OpenAI generation request: validate, tokenize once, fan out, stream or collect.

``handle_generation`` is called by the app's completion handlers. Streaming responses wait for the
first token before sending headers, so a failure before any output still gets its proper status
(503, 400, ...); later failures end the stream with an OpenAI error event and ``[DONE]``. A client
that disconnects, before or during the stream, closes the flow, which aborts on every worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.engine.role import Role
from tandem.router.body import read_capped
from tandem.router.errors import OpenAIError, bad_request, no_workers
from tandem.router.flow import (
    ChoiceFailed,
    ChoiceJob,
    TokenEvent,
    stream_choices,
    text_options,
)
from tandem.router.metrics import RouterMetrics
from tandem.router.protocol import ChatCompletionRequest, CompletionRequest, parse_body, validate
from tandem.router.sse import Kind, ResponseBuilder
from tandem.router.state import RouterState

T = TypeVar("T")


async def handle_generation(s: RouterState, request: Request, kind: Kind) -> Response:
    """Serve /v1/completions or /v1/chat/completions; never raises for bad input."""
    route = request.url.path
    arrival = time.monotonic()
    try:
        s.check_auth(request)
        raw = await read_capped(request, s.config.max_body_bytes)
        body = parse_body(raw, s.config.max_body_bytes)
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
        if kind is Kind.CHAT or _prompt_chars(req) > _OFFLOAD_CHARS:
            # Chat templates render, and long prompts tokenize, off the event loop and under a
            # deadline, so no request can stall every stream the router is relaying.
            encoded = await _off_loop(s, req)
        else:
            encoded = _encode_prompts(s, req)
        jobs, prompt_tokens = _make_jobs(s, req, request_id, encoded)
        s.metrics.prompt_tokens.inc(prompt_tokens)
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


_OFFLOAD_CHARS = 8192


def _prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    return sum(len(p) for p in req.prompts() if isinstance(p, str))


_RENDERERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="render")


async def _off_loop(
    s: RouterState, req: ChatCompletionRequest | CompletionRequest
) -> list[list[int]]:
    """``_encode_prompts`` on a small dedicated pool, bounded by ``template_timeout_s``. A render
    that overruns keeps its thread until it ends (threads cannot be killed), but the request is
    answered at once and the event loop never waits for it."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(_RENDERERS, _encode_prompts, s, req)
    try:
        return await asyncio.wait_for(fut, s.config.template_timeout_s)
    except TimeoutError:
        raise OpenAIError(
            400,
            f"Rendering and tokenizing the prompt took longer than "
            f"{s.config.template_timeout_s:g} s.",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="prompt_too_complex",
        ) from None


def _encode_prompts(
    s: RouterState, req: ChatCompletionRequest | CompletionRequest
) -> list[list[int]]:
    """Tokenize each prompt once (chat template for chat requests). Touches only the tokenizer,
    so it may run on a worker thread."""
    if isinstance(req, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return [s.encoder.encode_chat(messages, req.add_generation_prompt,
                                      req.chat_template_kwargs)]  # fmt: skip
    return [s.encoder.encode_text(p) if isinstance(p, str) else p for p in req.prompts()]


def _make_jobs(
    s: RouterState,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    prompts: list[list[int]],
) -> tuple[list[ChoiceJob], int]:
    """Check each tokenized prompt against the context length and fan out n choices."""
    max_len = s.registry.max_model_len()
    if max_len is None or not s.registry.by_role(Role.DECODE, Role.COLOCATED):
        raise no_workers("decode")
    if isinstance(req, ChatCompletionRequest):
        requested, param = req.requested_max_tokens(), "messages"
    else:
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
            jobs.append(ChoiceJob(request_id, len(jobs), ids, sampling, text_options(sampling)))
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
        prev = self._last[ev.choice]
        if prev is None:
            if not self._ttft_done:
                self._ttft_done = True
                self._m.ttft.observe(now - self._arrival)
            n_itl = n - 1  # the first token of a choice has no inter-token gap before it
        else:
            n_itl = n
        if prev is not None and n_itl > 0:
            for _ in range(n_itl):
                self._m.itl.observe((now - prev) / n_itl)
        if n:
            self._last[ev.choice] = now

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._tokens:  # requests that failed before any output are not latency samples
            self._m.e2e.observe(time.monotonic() - self._arrival)
        self._m.generation_tokens.inc(self._tokens)
