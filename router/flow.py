"""The P->D flow of DESIGN.md §5 for one OpenAI request, streamed as TokenEvents.

Called by the app's handlers after validation and tokenization (once per request). Each choice
(prompt x n) runs as its own task:

1. choose D among decode and colocated workers (prefix overlap against load);
2. decide local or remote prefill (``decide_prefill``: colocated D, no prefill worker, or an
   uncached part below the threshold means local);
3. remote: stream P with ``remote_decode`` and forward its first token at once; on a connection
   error, timeout or 5xx retry one other P, then fall back to local prefill on D; a 4xx goes back
   to the client. Then stream D with P's ``kv_transfer_params``.

Workers stream token ids; each choice keeps one text state (``engine.output_processor``:
detokenizer and stop strings) across its prefill and decode streams and turns their chunks into
the client's text. A stop string ends the choice at the token that completed it and aborts the
worker's sub-request (held-back text is never sent before a stop string is ruled out).

``stream_choices`` merges the choices' events. Closing it (client disconnect) cancels the tasks,
and each sends ``abort`` to every worker still running its sub-request. n > 1 fans out n
sub-requests of n=1, choice i seeded with seed + i, each placed on its own (prefix caching makes
the later prefills cheap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.hashing import HASH_ALGORITHM, BlockHash, hash_block_tokens
from tandem.engine.output_processor import SequenceOutput, TextOptions
from tandem.engine.role import Role
from tandem.router.errors import OpenAIError, no_workers
from tandem.router.metrics import RouterMetrics
from tandem.router.placement import (
    Candidate,
    Choice,
    Placer,
    PrefillMode,
    decide_prefill,
)
from tandem.router.prefix_index import PrefixIndex
from tandem.router.registry import WorkerRegistry, WorkerState
from tandem.router.tokenizer import PromptEncoder
from tandem.router.worker_client import (
    WorkerClient,
    WorkerRejected,
    WorkerUnavailable,
)


@dataclass(slots=True, frozen=True)
class FlowConfig:
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0  # 0: never treat the prefill pool as overloaded
    prefill_retries: int = 1  # other P workers tried after the first failure
    decode_retries: int = 1  # other D workers tried when D fails before any output
    poll_s: float = 0.25  # how often a silent stream re-checks that its worker is registered
    read_timeout_s: float = 300.0


@dataclass(slots=True)
class TokenEvent:
    """Output of one choice: a text delta and its tokens, or its end."""

    choice: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # True for a prefill worker's first token when decode follows: the TTFT metric waits for the
    # first decode token, so it covers prefill, KV transfer and the first decode step, and ITL
    # measures decode alone.
    handoff: bool = False
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class ChoiceJob:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams wire form, as the workers get it
    text: TextOptions = field(default_factory=TextOptions)  # applied here, to the token stream
    hashes: dict[int, list[BlockHash]] = field(default_factory=dict)  # per block size

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        if block_size not in self.hashes:
            self.hashes[block_size] = hash_block_tokens(self.prompt_token_ids, block_size)
        return self.hashes[block_size]


def text_options(sampling: dict[str, Any]) -> TextOptions:
    """What the router applies to a choice's token stream (stop strings, detokenization), from
    its SamplingParams wire dict. The workers get the whole dict and ignore these fields, as
    vLLM's engine core does."""
    return TextOptions(
        tuple(sampling.get("stop") or ()),
        bool(sampling.get("include_stop_str_in_output", False)),
        bool(sampling.get("skip_special_tokens", True)),
    )


class ChoiceFailed(Exception):
    """A choice failed after output reached the client; the stream ends with this error."""


@dataclass(slots=True)
class FlowContext:
    """Everything a flow needs; built once by the app's lifespan."""

    registry: WorkerRegistry
    index: PrefixIndex
    placer: Placer
    client: WorkerClient
    metrics: RouterMetrics
    config: FlowConfig
    encoder: PromptEncoder
    _aborts: set[asyncio.Task[bool]] = field(default_factory=set)

    def abort_soon(self, worker_url: str, request_id: str) -> None:
        """Send an abort in the background: the caller (a failing or cancelled choice) must not
        wait up to the control timeout on a hung worker. The task survives the caller's cancel."""
        task = asyncio.create_task(self.client.abort(worker_url, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def candidates(self, workers: list[WorkerState], job: ChoiceJob) -> list[Candidate]:
        out = []
        for w in workers:
            hashes = (
                job.block_hashes(w.info.block_size)
                if w.info.hash_algorithm == HASH_ALGORITHM
                else []
            )
            out.append(
                Candidate(
                    engine_id=w.info.engine_id,
                    overlap_blocks=self.index.overlap(w.info.engine_id, hashes),
                    request_blocks=len(hashes),
                    running=w.running,
                    waiting=w.waiting,
                    kv_usage=w.kv_usage,
                    inflight=w.inflight,
                )
            )
        return out

    def pick(
        self, pool: str, roles: tuple[Role, ...], job: ChoiceJob, exclude: set[str]
    ) -> tuple[WorkerState, Choice] | None:
        workers = [w for w in self.registry.by_role(*roles) if w.info.engine_id not in exclude]
        if not workers:
            return None
        choice = self.placer.choose(pool, self.candidates(workers, job))
        worker = self.registry.get(choice.engine_id)
        assert worker is not None  # chosen from the registry's live entries just above
        return worker, choice

    def record(self, pool: str, reason: str) -> None:
        self.metrics.placement(pool, self.placer.policy.label, reason)

    def expect_new_blocks(self, worker: WorkerState, choice: Choice, job: ChoiceJob) -> None:
        hashes = job.block_hashes(worker.info.block_size)
        if len(hashes) > choice.overlap_blocks:
            self.index.mark_expecting(worker.info.engine_id)


async def stream_choices(ctx: FlowContext, jobs: list[ChoiceJob]) -> AsyncIterator[TokenEvent]:
    """Run every choice concurrently and yield their events as they come.

    Raises OpenAIError when a choice fails before producing output, ChoiceFailed after. Closing the
    generator cancels the remaining choices, which abort their worker sub-requests.
    """
    queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

    async def run(job: ChoiceJob) -> None:
        try:
            await _run_choice(ctx, job, queue.put_nowait)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(run(job)) for job in jobs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


class _Choice:
    """One choice's delivered output: its text state (``SequenceOutput``: detokenizer, stop
    strings, tokens received) and the events handed to the client. It lives across the prefill
    -> decode hand-off and across retries, so text continues exactly where it stopped."""

    def __init__(self, ctx: FlowContext, job: ChoiceJob, emit: Callable[[TokenEvent], None]):
        self.job = job
        self.out: SequenceOutput[Any] = SequenceOutput.create(
            ctx.encoder.tokenizer, job.prompt_token_ids, job.text
        )
        self._emit = emit
        self._vocab = ctx.encoder.vocab_size()

    @property
    def emitted(self) -> bool:
        return self.out.num_tokens > 0

    def deliver(self, chunk: dict[str, Any], handoff: bool = False) -> bool:
        """Process one worker chunk and emit what the client gets; True once the choice ended
        (the caller then stops reading the worker, which aborts it if it still runs)."""
        token_ids, logprobs, reason = _chunk_fields(chunk, self._vocab)
        delta = self.out.process(token_ids, logprobs or (), reason, chunk.get("stop_reason"))
        cached = chunk.get("num_cached_tokens")
        ev = TokenEvent(
            choice=self.job.index,
            text=delta.text,
            token_ids=delta.token_ids,
            handoff=handoff and not self.out.finished,
            logprobs=delta.logprobs if logprobs is not None else None,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            num_cached_tokens=cached if isinstance(cached, int) else None,
        )
        if ev.token_ids or ev.text or ev.finish_reason is not None:
            self._emit(ev)
        return self.out.finished


async def _run_choice(ctx: FlowContext, job: ChoiceJob, emit: Callable[[TokenEvent], None]) -> None:
    choice = _Choice(ctx, job, emit)
    tried_d: set[str] = set()
    for _ in range(1 + ctx.config.decode_retries):
        picked = ctx.pick("decode", (Role.DECODE, Role.COLOCATED), job, tried_d)
        if picked is None:
            break
        d, d_choice = picked
        tried_d.add(d.info.engine_id)
        ctx.record(d.info.role.label, d_choice.reason)
        prefill_pool = ctx.registry.by_role(Role.PREFILL)
        decision = decide_prefill(
            prompt_tokens=len(job.prompt_token_ids),
            decode_cached_tokens=d_choice.overlap_blocks * d.info.block_size,
            threshold_tokens=ctx.config.local_prefill_threshold,
            decode_is_colocated=d.info.role is Role.COLOCATED,
            prefill_available=bool(prefill_pool),
            prefill_min_queue=min((w.waiting + w.inflight for w in prefill_pool), default=0),
            overload_queue=ctx.config.prefill_overload_queue,
        )
        kv_params: dict[str, Any] | None = None
        if decision.mode is PrefillMode.REMOTE:
            ctx.record("prefill", "remote")
            outcome = await _remote_prefill(ctx, choice)
            if outcome is _FINISHED:
                return
            if outcome is None:
                ctx.record("prefill", "local_fallback")
            else:
                kv_params = outcome
        else:
            ctx.record("prefill", decision.reason)
        if kv_params is None:
            ctx.expect_new_blocks(d, d_choice, job)
        try:
            await _decode(ctx, d, choice, kv_params)
            return
        except WorkerUnavailable as exc:
            if choice.emitted:
                raise ChoiceFailed(f"decode worker failed mid-stream: {exc}") from exc
    if not tried_d:
        raise no_workers("decode")
    raise OpenAIError(503, "Every decode worker tried for this request failed.", code="no_workers")


_FINISHED: dict[str, Any] = {}


async def _remote_prefill(ctx: FlowContext, choice: _Choice) -> dict[str, Any] | None:
    """Prefill on a P worker; returns its kv_transfer_params, ``_FINISHED`` when the request ended
    at the first token, or None when every attempt failed (fall back to local prefill)."""
    job = choice.job
    tried: set[str] = set()
    for attempt in range(1 + ctx.config.prefill_retries):
        picked = ctx.pick("prefill", (Role.PREFILL,), job, tried)
        if picked is None:
            return None
        p, p_choice = picked
        tried.add(p.info.engine_id)
        ctx.record("prefill", p_choice.reason)
        ctx.expect_new_blocks(p, p_choice, job)
        body = _generate_body(job, f"p{attempt}", None, remote_decode=True)
        try:
            async with contextlib.aclosing(_worker_stream(ctx, p, body)) as chunks:
                async for chunk in chunks:
                    reason = chunk.get("finish_reason")
                    handoff = reason == "remote_decode"
                    params = chunk.get("kv_transfer_params")
                    if handoff and not isinstance(params, dict):
                        raise WorkerUnavailable("prefill finished without kv_transfer_params")
                    if choice.deliver(chunk, handoff=handoff):
                        if handoff:  # a stop string ended it: free the blocks kept for decode
                            ctx.abort_soon(p.info.url, body["request_id"])
                        return _FINISHED
                    if handoff:
                        return params
        except WorkerUnavailable as exc:
            ctx.metrics.prefill_failures.inc()
            if choice.emitted:
                raise ChoiceFailed(f"prefill worker failed after its first token: {exc}") from exc
        except WorkerRejected as exc:
            raise _client_error(exc) from None
    return None


async def _decode(
    ctx: FlowContext, d: WorkerState, choice: _Choice, kv_params: dict[str, Any] | None
) -> None:
    body = _generate_body(choice.job, "d", kv_params, remote_decode=False)
    try:
        async with contextlib.aclosing(_worker_stream(ctx, d, body)) as chunks:
            async for chunk in chunks:
                if choice.deliver(chunk):
                    return
    except WorkerRejected as exc:
        raise _client_error(exc) from None


def _generate_body(
    job: ChoiceJob,
    suffix: str,
    kv_params: dict[str, Any] | None,
    remote_decode: bool,
) -> dict[str, Any]:
    return {
        "request_id": f"{job.request_id}-{job.index}-{suffix}",
        "prompt_token_ids": job.prompt_token_ids,
        "sampling_params": job.sampling,
        "kv_transfer_params": kv_params,
        "remote_decode": remote_decode,
    }


async def _worker_stream(
    ctx: FlowContext, worker: WorkerState, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """Chunks of one sub-request up to and including the one with a finish_reason.

    Raises WorkerUnavailable when the worker fails, leaves the registry or stays silent past the
    read timeout; aborts the sub-request on the worker unless it finished.
    """
    url, engine_id = worker.info.url, worker.info.engine_id
    stream = ctx.client.generate(url, body)
    worker.inflight += 1
    finished = False
    try:
        silent = 0.0
        while True:
            try:
                chunk = await stream.next_chunk(ctx.config.poll_s)
            except TimeoutError:
                silent += ctx.config.poll_s
                if not ctx.registry.is_live(engine_id):
                    raise WorkerUnavailable(f"worker {engine_id} left the registry") from None
                if silent >= ctx.config.read_timeout_s:
                    raise WorkerUnavailable(
                        f"worker {engine_id} silent for {silent:.0f} s"
                    ) from None
                continue
            silent = 0.0
            if chunk is None:
                raise WorkerUnavailable("worker stream ended without a finish_reason")
            reason = chunk.get("finish_reason")
            if reason in ("error", "abort") or chunk.get("error"):
                err = chunk.get("error") or {}
                msg = err.get("message") if isinstance(err, dict) else str(err)
                raise WorkerUnavailable(f"worker ended the request ({reason}): {msg}")
            finished = reason is not None
            yield chunk
            if finished:
                return
    finally:
        worker.inflight -= 1
        if not finished:
            ctx.abort_soon(url, body["request_id"])
        # Shielded: a second cancellation (client gone, gather cancelled) must not leak the stream.
        await asyncio.shield(stream.aclose())


def _chunk_fields(
    chunk: dict[str, Any], vocab: int
) -> tuple[list[int], list[Any] | None, str | None]:
    """A worker chunk's token ids, logprobs and finish reason; WorkerUnavailable if malformed."""
    token_ids = chunk.get("token_ids") or []
    logprobs = chunk.get("logprobs")
    reason = chunk.get("finish_reason")
    if not isinstance(token_ids, list) or not all(
        type(t) is int and 0 <= t < vocab for t in token_ids
    ):
        raise WorkerUnavailable("worker chunk has malformed token_ids")
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != len(token_ids)):
        raise WorkerUnavailable("worker chunk has malformed logprobs")
    if reason is not None and not isinstance(reason, str):
        raise WorkerUnavailable("worker chunk has a malformed finish_reason")
    return token_ids, logprobs, reason


def _client_error(exc: WorkerRejected) -> OpenAIError:
    err = exc.error
    return OpenAIError(
        exc.status,
        str(err.get("message") or exc),
        param=err.get("param"),
        code=err.get("code"),
    )
