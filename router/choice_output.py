"""One choice's output at the router: worker chunks (token ids) in, the client's events out.

Each choice of a request keeps one ``ChoiceOutput`` for its whole life (``flow.py``): across the
prefill -> decode hand-off, retries and migrations to other workers, so its text continues
exactly where it stopped and ``token_ids`` is everything the client received (what a migrated
stream re-submits). The text state is the engine's ``output_processor.SequenceOutput``
(incremental detokenizer and stop strings at O(stop length) per token, as in vLLM v1's output
processor). A stop string ends the choice at the token that completed it: the caller stops
reading the worker, which aborts the worker's sub-request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.output_processor import SequenceOutput, TextOptions
from tandem.router.tokenizer import PromptEncoder
from tandem.router.worker_client import WorkerUnavailable


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


def text_options(sampling: dict[str, Any]) -> TextOptions:
    """What the router applies to a choice's token stream (stop strings, detokenization), from
    its SamplingParams wire dict. The workers get the whole dict and ignore these fields, as
    vLLM's engine core does."""
    return TextOptions(
        tuple(sampling.get("stop") or ()),
        bool(sampling.get("include_stop_str_in_output", False)),
        bool(sampling.get("skip_special_tokens", True)),
    )


class ChoiceOutput:
    """Owned by one choice's task in ``flow.py``; ``emit`` hands events to the response."""

    def __init__(
        self,
        encoder: PromptEncoder,
        index: int,
        prompt_token_ids: list[int],
        text: TextOptions,
        emit: Callable[[TokenEvent], None],
    ) -> None:
        self.index = index
        self.out: SequenceOutput[Any] = SequenceOutput.create(
            encoder.tokenizer, prompt_token_ids, text
        )
        self._emit = emit
        self._vocab = encoder.vocab_size()

    @property
    def emitted(self) -> bool:
        return self.out.num_tokens > 0

    @property
    def num_tokens(self) -> int:
        return self.out.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.out.token_ids

    def deliver(self, chunk: dict[str, Any], handoff: bool = False) -> bool:
        """Process one worker chunk and emit what the client gets; True once the choice ended
        (the caller then stops reading the worker, which aborts it if it still runs)."""
        token_ids, logprobs, reason = chunk_fields(chunk, self._vocab)
        delta = self.out.process(token_ids, logprobs or (), reason, chunk.get("stop_reason"))
        cached = chunk.get("num_cached_tokens")
        ev = TokenEvent(
            choice=self.index,
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


def chunk_fields(
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
