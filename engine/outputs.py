"""The values that flow through one engine step (DEVELOPERS.md: state flows through arguments):

Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
-> Scheduler.update() -> Engine -> EngineOutput (one per request that changed)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs | None] = field(default_factory=dict)


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


def request_outputs(
    reqs: list[Request], logprobs: dict[str, TokenLogprobs | None], new_token: bool = True
) -> list[EngineOutput]:
    """Each request's step output: its newest token (``new_token``) and that token's logprobs if
    sampled, plus its state (finish reason, counts, error). One comprehension: at 256 decoding
    sequences a function call per request was a sixth of the engine thread's time."""
    fin, out = RequestStatus.FINISHED_STOPPED, EngineOutput
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
        )
        for r in reqs
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
