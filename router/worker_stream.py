"""One sub-request on one worker, as the flow (``flow.py``) sees it: the generate body, the
chunk stream with its liveness checks, and the abort when the stream is left unfinished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tandem.router.errors import OpenAIError
from tandem.router.registry import WorkerState
from tandem.router.worker_client import WorkerRejected, WorkerUnavailable

if TYPE_CHECKING:
    from tandem.router.flow import ChoiceJob, FlowContext


def generate_body(
    job: ChoiceJob,
    suffix: str,
    kv_params: dict[str, Any] | None = None,
    remote_decode: bool = False,
    resume_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The internal generate request (docs/internal-api.md) of one attempt of one choice."""
    body: dict[str, Any] = {
        "request_id": f"{job.request_id}-{job.index}-{suffix}",
        "prompt_token_ids": job.prompt_token_ids,
        "sampling_params": job.sampling,
        "kv_transfer_params": kv_params,
        "remote_decode": remote_decode,
        "priority": job.priority,
    }
    if resume_token_ids:
        body["resume_token_ids"] = list(resume_token_ids)
    return body


_SILENT: dict[str, Any] = {}  # no chunk within the poll interval


async def worker_stream(
    ctx: FlowContext, worker: WorkerState, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """Chunks of one sub-request up to and including the one with a finish_reason.

    Raises WorkerUnavailable when the worker fails, expires from the registry or stays silent
    past the read timeout; aborts the sub-request on the worker unless it finished.
    """
    url, engine_id = worker.info.url, worker.info.engine_id
    losses = ctx.registry.losses(engine_id)
    stream = ctx.client.generate(url, body)
    worker.inflight += 1
    finished = False
    try:
        silent = 0.0
        while True:
            try:
                chunk = await stream.next_chunk(ctx.config.poll_s)
            except TimeoutError:
                chunk = _SILENT
            # A draining worker has deregistered but finishes its streams; one whose heartbeats
            # stopped (or that was replaced by a restart) since this stream began is given up,
            # even when it comes back with output: the router may already have moved its work.
            if ctx.registry.losses(engine_id) != losses:
                raise WorkerUnavailable(f"worker {engine_id} stopped heartbeating")
            if chunk is _SILENT:
                silent += ctx.config.poll_s
                if silent >= ctx.config.read_timeout_s:
                    raise WorkerUnavailable(f"worker {engine_id} silent for {silent:.0f} s")
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


def client_error(exc: WorkerRejected) -> OpenAIError:
    """A worker's 4xx, passed on to the client: the request itself is at fault."""
    err = exc.error
    return OpenAIError(
        exc.status,
        str(err.get("message") or exc),
        param=err.get("param"),
        code=err.get("code"),
    )
