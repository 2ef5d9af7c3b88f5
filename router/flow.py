"""The P->D flow of DESIGN.md §5 for one OpenAI request, streamed as TokenEvents.

Called by the app's handlers after validation, tokenization and admission (once per request).
Each choice (prompt x n) runs as its own task:

1. choose D among decode and colocated workers (prefix overlap against load);
2. decide local or remote prefill (``decide_prefill``: colocated D, no prefill worker, or an
   uncached part below the threshold means local);
3. remote: stream P with ``remote_decode`` and forward its first token at once; on a connection
   error, timeout or 5xx retry one other P, then fall back to local prefill on D; a 4xx goes back
   to the client. Then stream D with P's ``kv_transfer_params``.

Workers stream token ids; each choice keeps one ``ChoiceOutput`` (text state, tokens delivered)
across all its worker streams (``choice_output.py``).

Decode failures (connection lost, 5xx, an error chunk, the worker leaving the registry):

- nothing delivered yet (local prefill): retry another D, ``decode_retries`` times;
- after prefill's token but before decode's first: retry another decode worker with the same
  ``kv_transfer_params`` (prefill keeps the blocks under its lease, which the new decode renews;
  if they are gone meanwhile, that decode recomputes the prompt);
- after decode's tokens: **migrate**: re-submit the prompt with the tokens delivered so far as
  ``resume_token_ids`` to another decode or colocated worker, which re-prefills them and
  continues; the client sees one stream with nothing repeated or missing.

Moving a stream that has output counts against ``migration_limit`` (0: never) and is counted in
``tandem_router_migrations_total{reason}`` (``kv_retry`` or ``resume``). A choice that fails
for good after a hand-off aborts its prefill sub-request, so the pinned blocks go at once.

``stream_choices`` merges the choices' events. Closing it (client disconnect, deadline) cancels
the tasks, and each sends ``abort`` to every worker still running its sub-request. n > 1 fans out
n sub-requests of n=1, choice i seeded with seed + i, each placed on its own (prefix caching
makes the later prefills cheap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.hashing import HASH_ALGORITHM, BlockHash, hash_block_tokens
from tandem.engine.output_processor import TextOptions
from tandem.engine.role import Role
from tandem.router.choice_output import ChoiceOutput, TokenEvent, text_options
from tandem.router.errors import OpenAIError, no_workers
from tandem.router.metrics import RouterMetrics
from tandem.router.peer_pull import peer_grant
from tandem.router.placement import Candidate, Choice, Placer, PrefillMode, decide_prefill
from tandem.router.prefix_index import PrefixIndex
from tandem.router.registry import WorkerRegistry, WorkerState
from tandem.router.tokenizer import PromptEncoder
from tandem.router.worker_client import WorkerClient, WorkerRejected, WorkerUnavailable
from tandem.router.worker_stream import client_error, generate_body, worker_stream

__all__ = ["ChoiceFailed", "ChoiceJob", "FlowConfig", "FlowContext", "TokenEvent",
           "stream_choices", "text_options"]  # fmt: skip


@dataclass(slots=True, frozen=True)
class FlowConfig:
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0  # 0: never treat the prefill pool as overloaded
    prefill_retries: int = 1  # other P workers tried after the first failure
    decode_retries: int = 1  # other D workers tried when D fails before any output
    migration_limit: int = 1  # moves of a stream that has output to another worker (0: never)
    poll_s: float = 0.25  # how often a silent stream re-checks that its worker is registered
    read_timeout_s: float = 300.0
    # Pull a prompt's prefix from a peer holding at least this many more tokens of it than the
    # chosen worker (peer_pull.py); 0: never.
    peer_pull_min_tokens: int = 0


@dataclass(slots=True)
class ChoiceJob:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams wire form, as the workers get it
    text: TextOptions = field(default_factory=TextOptions)  # applied here, to the token stream
    priority: int = 0  # lower is served first (the workers' queues too)
    hashes: dict[int, list[BlockHash]] = field(default_factory=dict)  # per block size

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        if block_size not in self.hashes:
            self.hashes[block_size] = hash_block_tokens(self.prompt_token_ids, block_size)
        return self.hashes[block_size]


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
            hit = self.index.tiered_overlap(w.info.engine_id, hashes)
            out.append(
                Candidate(
                    engine_id=w.info.engine_id,
                    overlap_blocks=hit.device,
                    request_blocks=len(hashes),
                    running=w.running,
                    waiting=w.waiting,
                    kv_usage=w.kv_usage,
                    inflight=w.inflight,
                    host_overlap_blocks=hit.host,
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
        if len(hashes) > choice.overlap_blocks:  # host hits load back: device events follow
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


@dataclass(slots=True)
class _Handoff:
    """A prefill's hand-off: where decode pulls from, and the prefill sub-request to abort if
    no decode ever takes it."""

    params: dict[str, Any]
    prefill_url: str
    prefill_request_id: str
    fingerprint: str | None  # the prefill's: only a decode of the same one can use the KV


_FINISHED = object()


async def _run_choice(ctx: FlowContext, job: ChoiceJob, emit: Callable[[TokenEvent], None]) -> None:
    choice = ChoiceOutput(ctx.encoder, job.index, job.prompt_token_ids, job.text, emit)
    excluded: set[str] = set()  # decode-side workers that failed this choice
    retries = migrations = 0
    handoff: _Handoff | None = None  # valid until a decode delivers a token past it
    last_error: Exception | None = None
    attempt = 0
    try:
        while True:
            roles = (Role.DECODE,) if handoff is not None else (Role.DECODE, Role.COLOCATED)
            skip = excluded if handoff is None else excluded | _unfit(ctx, handoff.fingerprint)
            picked = ctx.pick("decode", roles, job, skip)
            if picked is None and handoff is not None:
                handoff = _drop(ctx, handoff)  # no decode worker left: re-prefill elsewhere
                continue
            if picked is None:
                if not excluded:
                    raise no_workers("decode")
                if choice.emitted:
                    raise ChoiceFailed(f"decode worker failed mid-stream: {last_error}")
                raise OpenAIError(
                    503, "Every decode worker tried for this request failed.", code="no_workers"
                )
            d, d_choice = picked
            ctx.record(d.info.role.label, d_choice.reason)
            resume: list[int] = []
            if choice.emitted and handoff is None:
                resume = list(choice.token_ids)  # a migration: re-prefill what was delivered
            elif not choice.emitted:
                outcome = await _prefill_for(ctx, choice, job, d, d_choice)
                if outcome is _FINISHED:
                    return
                handoff = outcome if isinstance(outcome, _Handoff) else None
            grant = None
            if handoff is None:
                ctx.expect_new_blocks(d, d_choice, job)
                if not resume:
                    grant = await peer_grant(ctx, job, d, d_choice, f"g{attempt}")
            before = choice.num_tokens
            try:
                kv = handoff.params if handoff is not None else None
                body = generate_body(job, f"d{attempt}", kv, False, resume)
                if grant is not None:
                    body["kv_prefix_params"] = grant.params
                await _decode(ctx, d, choice, body)
                return
            except WorkerUnavailable as exc:
                if grant is not None:  # the source's blocks go now, not at lease expiry
                    ctx.abort_soon(grant.source_url, grant.grant_id)
                excluded.add(d.info.engine_id)
                last_error = exc
                attempt += 1
                if choice.num_tokens > before and handoff is not None:
                    handoff = _drop(ctx, handoff)  # decode moved past the hand-off
            if not choice.emitted:
                retries += 1
                if retries > ctx.config.decode_retries:
                    raise OpenAIError(
                        503, "Every decode worker tried for this request failed.",
                        code="no_workers",
                    )  # fmt: skip
                continue
            if migrations >= ctx.config.migration_limit:
                raise ChoiceFailed(f"decode worker failed mid-stream: {last_error}")
            migrations += 1
            ctx.metrics.migration("kv_retry" if handoff is not None else "resume")
    except (ChoiceFailed, OpenAIError):
        if handoff is not None:  # no decode took the prefill's blocks: free them now
            ctx.abort_soon(handoff.prefill_url, handoff.prefill_request_id)
        raise


def _unfit(ctx: FlowContext, fingerprint: str | None) -> set[str]:
    """Decode workers that cannot use KV of ``fingerprint`` (another model, dtype or version)."""
    return {w.info.engine_id for w in ctx.registry.by_role(Role.DECODE)
            if w.info.fingerprint != fingerprint}  # fmt: skip


def _drop(ctx: FlowContext, handoff: _Handoff) -> None:
    """The hand-off will not be used: release the prefill's blocks now (best effort). Returns
    None, the caller's new hand-off."""
    ctx.abort_soon(handoff.prefill_url, handoff.prefill_request_id)


async def _prefill_for(
    ctx: FlowContext, choice: ChoiceOutput, job: ChoiceJob, d: WorkerState, d_choice: Choice
) -> object:
    """Decide where the prompt is prefilled for decode worker ``d``: a ``_Handoff`` from a
    prefill worker, ``_FINISHED`` when the request ended at prefill's token, None for local."""
    registered = ctx.registry.by_role(Role.PREFILL)
    # Only prefill workers whose KV this decode can use (same model, checkpoint, dtype, version:
    # the fingerprint); with none left, decode prefills locally.
    prefill_pool = [w for w in registered if w.info.fingerprint == d.info.fingerprint]
    decision = decide_prefill(
        prompt_tokens=len(job.prompt_token_ids),
        decode_cached_tokens=d_choice.cached_blocks * d.info.block_size,
        threshold_tokens=ctx.config.local_prefill_threshold,
        decode_is_colocated=d.info.role is Role.COLOCATED,
        prefill_available=bool(prefill_pool),
        prefill_incompatible=bool(registered) and not prefill_pool,
        prefill_min_queue=min((w.waiting + w.inflight for w in prefill_pool), default=0),
        overload_queue=ctx.config.prefill_overload_queue,
    )
    if decision.mode is not PrefillMode.REMOTE:
        ctx.record("prefill", decision.reason)
        return None
    ctx.record("prefill", "remote")
    unfit = {w.info.engine_id for w in registered} - {w.info.engine_id for w in prefill_pool}
    outcome = await _remote_prefill(ctx, choice, job, unfit)
    if outcome is None:
        ctx.record("prefill", "local_fallback")
    return outcome


async def _remote_prefill(
    ctx: FlowContext, choice: ChoiceOutput, job: ChoiceJob, unfit: set[str]
) -> object:
    """Prefill on a P worker (never one in ``unfit``); a ``_Handoff``, ``_FINISHED`` when the
    request ended at the first token, or None when every attempt failed (local prefill)."""
    tried: set[str] = set(unfit)
    for attempt in range(1 + ctx.config.prefill_retries):
        picked = ctx.pick("prefill", (Role.PREFILL,), job, tried)
        if picked is None:
            return None
        p, p_choice = picked
        tried.add(p.info.engine_id)
        ctx.record("prefill", p_choice.reason)
        ctx.expect_new_blocks(p, p_choice, job)
        body = generate_body(job, f"p{attempt}", None, remote_decode=True)
        try:
            async with contextlib.aclosing(worker_stream(ctx, p, body)) as chunks:
                async for chunk in chunks:
                    reason = chunk.get("finish_reason")
                    is_handoff = reason == "remote_decode"
                    params = chunk.get("kv_transfer_params")
                    if is_handoff and not isinstance(params, dict):
                        raise WorkerUnavailable("prefill finished without kv_transfer_params")
                    if choice.deliver(chunk, handoff=is_handoff):
                        if is_handoff:  # a stop string ended it: free the blocks kept for decode
                            ctx.abort_soon(p.info.url, body["request_id"])
                        return _FINISHED
                    if is_handoff:
                        assert isinstance(params, dict)
                        return _Handoff(params, p.info.url, body["request_id"], p.info.fingerprint)
        except WorkerUnavailable as exc:
            ctx.metrics.prefill_failures.inc()
            if choice.emitted:
                raise ChoiceFailed(f"prefill worker failed after its first token: {exc}") from exc
        except WorkerRejected as exc:
            raise client_error(exc) from None
    return None


async def _decode(
    ctx: FlowContext, d: WorkerState, choice: ChoiceOutput, body: dict[str, Any]
) -> None:
    try:
        async with contextlib.aclosing(worker_stream(ctx, d, body)) as chunks:
            async for chunk in chunks:
                if choice.deliver(chunk):
                    return
    except WorkerRejected as exc:
        raise client_error(exc) from None
