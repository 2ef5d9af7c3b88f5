"""The values that flow through one engine step (DEVELOPERS.md: state flows through arguments):

Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
-> Scheduler.update() -> Engine -> EngineOutput (one per request that changed)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from tandem.engine.request import RequestStatus

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.sampler import TokenLogprobs


@dataclass(slots=True, frozen=True)
class ScheduledRequest:
    """One row of a step. Frozen: the scheduler reuses a running request's decode row."""

    request: Request
    num_new_tokens: int
    # The chunk reaches the last known token, so its last position's logits are sampled.
    sample: bool


@dataclass(slots=True)
class LoadSpec:
    """A request whose prompt KV comes from elsewhere: fill ``local_block_ids[i]`` with the
    source's ``remote_block_ids[i]``. Made by the scheduler on admission; the role hooks start
    the transfer. The scheduler owns the local blocks until ``Scheduler.finish_load``."""

    request: Request
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Of those, tokens of prompts (the chunks' parts short of each prompt's end).
    num_prompt_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # KV loads admitted this step, for the role hooks to start (decode role).
    loads: list[LoadSpec] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """One token per sampled row, in the step's order (the ``SchedulerOutput`` rows with
    ``sample`` set; a list, not a dict by id: building and reading 256 ids a step was a tenth
    of the engine thread's time); logprobs by request id, where asked for."""

    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs | None] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class RequestTimings:
    """Where a request's time went on this engine (``time.monotonic()`` seconds), carried by its
    final EngineOutput: arrival (the worker's HTTP handler, or ``add_request``), first admission
    by the scheduler, the first token this engine sampled (None: none), the end. A decode
    worker's request is admitted when its KV pull starts; its first token is its first decode
    step's. Read by the worker's latency histograms (engine/worker/metrics.py)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float

    @classmethod
    def of(cls, req: Request, now: float) -> RequestTimings:
        return cls(
            req.arrival_time,
            req.first_scheduled_time or None,
            req.first_token_time or None,
            now,
        )

    @property
    def queue_seconds(self) -> float | None:
        """Arrival to first admission (None: never admitted)."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def first_token_seconds(self) -> float | None:
        """Arrival to the first token sampled here (None: none was)."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def total_seconds(self) -> float:
        return self.finished - self.arrival


@dataclass(slots=True)
class EngineOutput:
    """What one request produced in one step (a delta of token ids), or its end. Text is made
    downstream (``output_processor.py``)."""

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # Prefill role: where the decode worker pulls this request's KV from (wire dict).
    kv_transfer_params: dict[str, Any] | None = None
    timings: RequestTimings | None = None  # on a finished output (and only there)


def request_outputs(
    reqs: list[Request], logprobs: dict[str, TokenLogprobs | None], new_token: bool = True
) -> list[EngineOutput]:
    """Each request's step output: its newest token (``new_token``) and that token's logprobs if
    sampled, plus its state (finish reason, counts, error). One comprehension: at 256 decoding
    sequences a function call per request was a sixth of the engine thread's time."""
    fin, out, timed = RequestStatus.FINISHED_STOPPED, EngineOutput, RequestTimings.of
    now = time.monotonic()  # the end of every request that finishes here
    return [
        out(
            r.request_id,
            r.group_id,
            r.group_index,
            [r.output_token_ids[-1]] if new_token else [],
            (status := r.status) >= fin,
            status.finish_reason if status >= fin else None,
            r.stop_reason,
            [lp] if logprobs and (lp := logprobs.get(r.request_id)) is not None else [],
            len(r.prompt_token_ids),
            max(r.num_cached_tokens, 0),
            r.error,
            None,
            timed(r, now) if status >= fin else None,
        )
        for r in reqs
    ]


class StepOutputs(Sequence[EngineOutput]):
    """The outputs of a step in which every request that produced a token goes on: one token
    each, nothing finished (the steady decode step). Returned by ``Engine.step()``.

    The engine thread keeps only a snapshot (the requests, their new tokens, the step's logprobs);
    the ``EngineOutput``s are made when a reader first looks (the worker's event loop, which
    runs the step's hand-over while the engine thread is in the next forward pass; the offline
    ``LLM``). At 256 sequences making them was a fifth of the engine thread's time outside the
    model. What the reader's outputs take from the requests is fixed once a request runs (ids,
    index, prompt length, cached tokens); the one field that moves, the token, is in the snapshot.
    Read from one thread at a time.
    """

    __slots__ = ("_reqs", "_tokens", "_logprobs", "_outs")

    def __init__(
        self, reqs: list[Request], tokens: list[int], logprobs: dict[str, TokenLogprobs | None]
    ) -> None:
        self._reqs = reqs
        self._tokens = tokens
        self._logprobs = logprobs
        self._outs: list[EngineOutput] | None = None

    def _made(self) -> list[EngineOutput]:
        if self._outs is None:
            self._outs = running_outputs(self._reqs, self._tokens, self._logprobs)
        return self._outs

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[EngineOutput]:
        return iter(self._made())

    @overload
    def __getitem__(self, i: int) -> EngineOutput: ...
    @overload
    def __getitem__(self, i: slice) -> list[EngineOutput]: ...
    def __getitem__(self, i: int | slice) -> EngineOutput | list[EngineOutput]:
        return self._made()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepOutputs):
            return self._made() == other._made()
        return isinstance(other, list) and self._made() == other

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        return f"StepOutputs({self._made()!r})"


def running_outputs(
    reqs: list[Request], tokens: list[int], logprobs: dict[str, TokenLogprobs | None]
) -> list[EngineOutput]:
    """``request_outputs`` for requests that go on, with their new tokens given (StepOutputs)."""
    out = EngineOutput
    return [
        out(
            r.request_id,
            r.group_id,
            r.group_index,
            [token],
            False,
            None,
            None,
            [lp] if logprobs and (lp := logprobs.get(r.request_id)) is not None else [],
            len(r.prompt_token_ids),
            max(r.num_cached_tokens, 0),
            None,
        )
        for r, token in zip(reqs, tokens, strict=True)
    ]


@dataclass(slots=True, frozen=True)
class HostTierStats:
    num_blocks: int
    usage: float
    # Prompt tokens whose KV was loaded from the host tier instead of computed.
    hit_tokens: int
    offloaded_blocks: int
    loaded_blocks: int
    # (reason, count): host blocks refused by a load's checks (IntegrityFailure values).
    integrity_failures: tuple[tuple[str, int], ...]


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    # Every preemption; the swap ones are also counted apart (the rest recomputed).
    num_preemptions: int
    num_swap_preemptions: int = 0
    host_tier: HostTierStats | None = None
