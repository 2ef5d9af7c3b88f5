"""Output processing of one sequence where its tokens leave the system: text, stop strings, and
what the client has received.

As in vLLM v1's output processor, the engine's step streams token ids only; text is made by
whoever hands output to a user: the router for served requests (``tandem.router.flow``, one
``SequenceOutput`` per choice) and the offline ``LLM`` (``llm.py``, outside ``Engine.step()``).
Both feed each engine delta (token ids, logprobs, the engine's finish reason) to ``process`` and
get back the delta to deliver. When a stop string matches, ``process`` cuts the tokens, logprobs
and text at the token that completed it and reports ``stopped_by_string``: the caller then aborts
the request in the engine (or on the worker), whose later tokens are never delivered.

The object outlives any one engine request: the router keeps it across the prefill -> decode
hand-off and across a migration to another worker, so text continues exactly where it stopped
(``token_ids`` is everything delivered so far, what a migrated request re-submits). Torch-free;
not thread-safe (one owner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tandem.engine.detokenizer import IncrementalDetokenizer, TextParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

L = TypeVar("L")

# Engine finish reasons after which the sequence's text is complete (flush what was held back).
# "remote_decode" is not one: the sequence continues on a decode worker.
TEXT_FINAL_REASONS = frozenset({"stop", "length"})


@dataclass(slots=True, frozen=True)
class TextOptions:
    """The text-shaping sampling fields, apart from the rest (the router keeps these and sends
    the workers the others)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass(slots=True)
class OutputDelta(Generic[L]):
    """What to deliver for one engine delta. ``finish_reason`` is None while the sequence runs."""

    token_ids: list[int]
    logprobs: list[L]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # A stop string matched: the caller must abort the request upstream (it still runs there).
    stopped_by_string: bool = False


@dataclass(slots=True)
class SequenceOutput(Generic[L]):
    """One output sequence's delivered state (tokens, text state, finish)."""

    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def create(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: TextParams,
    ) -> SequenceOutput[Any]:
        return cls(IncrementalDetokenizer(tokenizer, prompt_token_ids, params))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def process(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[L] = (),
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> OutputDelta[L]:
        """Feed one engine delta. ``finish_reason`` is the engine's (None while it runs); a
        reason outside ``TEXT_FINAL_REASONS`` (abort, error, remote_decode) leaves the text open.
        After the sequence finished, further deltas deliver nothing."""
        if self.finished:
            return OutputDelta([], [], "")
        detok = self.detokenizer
        text: list[str] = []
        for i, tok in enumerate(token_ids):
            step = detok.append([tok])
            text.append(step.text_delta)
            if step.stop_str is not None:
                # A stop string outranks length/EOS ending on the same token.
                self.token_ids.extend(token_ids[: i + 1])
                self.finish_reason, self.stop_reason = "stop", step.stop_str
                return OutputDelta(
                    list(token_ids[: i + 1]), list(logprobs[: i + 1]), "".join(text), "stop",
                    step.stop_str, stopped_by_string=True,
                )  # fmt: skip
        self.token_ids.extend(token_ids)
        if finish_reason in TEXT_FINAL_REASONS:
            text.append(detok.finish())
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return OutputDelta(
            list(token_ids), list(logprobs), "".join(text),
            finish_reason if finish_reason in TEXT_FINAL_REASONS else None, stop_reason,
        )  # fmt: skip
