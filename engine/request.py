"""A request's state as the scheduler, model runner and workers see it."""

from __future__ import annotations

import time
from enum import IntEnum
from typing import TYPE_CHECKING

from tandem.engine.hashing import BlockHash, hash_block

if TYPE_CHECKING:
    import torch

    from tandem.engine.kv_connector import KVTransferParams
    from tandem.engine.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    # Admitted; its blocks are being loaded back from the host KV tier (prefix hit or swap-in).
    WAITING_FOR_HOST_KV = 4
    # Everything from here on is finished; the scheduler no longer holds the request.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13
    # Prefill role: the prompt is done and its blocks are handed to a decode worker.
    FINISHED_REMOTE_DECODE = 14

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason string, or None while the request runs."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REMOTE_DECODE: "remote_decode",
}


class Request:
    """One sequence being generated. Created by the Engine, owned by the Scheduler while unfinished.

    ``block_ids`` is the block table; the KVCacheManager owns the blocks and this list mirrors them.
    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix hits included).
    Slotted: the engine thread reads a handful of these fields per request per step.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "params", "eos_token_ids", "priority", "arrival_time",
        "generator", "group_id", "group_index", "max_tokens", "block_size", "status",
        "output_token_ids", "all_token_ids", "num_computed_tokens", "num_cached_tokens",
        "block_ids", "block_hashes", "num_preemptions", "stop_reason", "waited_steps",
        "remote_decode", "kv_transfer_params", "error", "first_scheduled_time", "first_token_time",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int],
        block_size: int,
        priority: int = 0,
        arrival_time: float | None = None,
        generator: torch.Generator | None = None,
        group_id: str | None = None,
        group_index: int = 0,
        max_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.generator = generator
        self.group_id = group_id or request_id
        self.group_index = group_index
        self.max_tokens = max_tokens
        self.block_size = block_size

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not admitted yet
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.waited_steps = 0
        # Set by the worker role (see Scheduler): hand off after the prompt (prefill), or the
        # prompt's KV comes from elsewhere (decode).
        self.remote_decode = False
        self.kv_transfer_params: KVTransferParams | None = None
        self.error: str | None = None
        # time.monotonic() when the scheduler first admitted it and when this engine sampled its
        # first token (0.0: not yet); the worker's latency histograms read them at its end.
        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self._update_block_hashes()

    @property
    def prompt_done_once(self) -> bool:
        """Its prompt was computed through to a sampled token at least once (n > 1 siblings wait
        for their leader's; a preempted request keeps it)."""
        return self.first_token_time > 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Extend the chained hashes to every full block of all_token_ids (prompt and output)."""
        bs = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else None
        for start in range(len(self.block_hashes) * bs, len(self.all_token_ids) - bs + 1, bs):
            parent = hash_block(parent, self.all_token_ids[start : start + bs])
            self.block_hashes.append(parent)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
