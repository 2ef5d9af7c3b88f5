"""Incremental detokenizer with stop strings (DESIGN.md §3, "Output").

Text is made where output leaves the serving system, as in vLLM v1's output processor: the
router for served requests and the offline ``LLM`` (both through ``output_processor.py``), never
the engine's step. One :class:`IncrementalDetokenizer` per output sequence is fed each new token
id with :meth:`~IncrementalDetokenizer.append`, and ``text_delta`` goes to the client. Two things
are held back from the stream:

- text whose last character is an incomplete multi-byte UTF-8 sequence (the decode ends in
  U+FFFD): it is emitted once a later token completes it;
- a suffix of the text that is a proper prefix of some stop string: emitted as soon as the text
  that follows rules the stop string out.

Decoding follows vLLM's offsets scheme: only a bounded window of ids is decoded per step, from
``prefix_offset`` (a few tokens of context, so SentencePiece-style leading spaces come out right)
to the end; the delta is the window's text beyond the text of ``[prefix_offset, read_offset)``.
The first output token is decoded with up to :data:`PROMPT_CONTEXT_TOKENS` prompt tokens as
context. Decoding never applies ``clean_up_tokenization_spaces``: that rewrite is not local, so
streaming could not reproduce it.

Stop strings: the stop is the first match to *complete* in the output text (smallest end
offset; among matches ending together, the longest). This depends only on the text, never on how
tokens were grouped into ``append`` calls. The output is cut before the stop string, or after it
with ``include_stop_str_in_output``. The check costs O(stop length) per token at worst, never
O(output) (``stop_strings.StopMatcher``); only the held-back tail is kept, not the output text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.engine.stop_strings import StopMatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class TextParams(Protocol):
    """The sampling fields that shape the text (``SamplingParams`` and the router's
    ``output_processor.TextOptions`` have them)."""

    @property
    def stop(self) -> Sequence[str]: ...

    @property
    def include_stop_str_in_output(self) -> bool: ...

    @property
    def skip_special_tokens(self) -> bool: ...


@dataclass(slots=True, frozen=True)
class DetokenizerStep:
    """What one ``append`` produced: text to stream, and the stop string if one matched.

    When ``stop_str`` is not None the request must finish with reason "stop"; ``text_delta`` is
    then the last text of the sequence (already cut).
    """

    text_delta: str
    stop_str: str | None


class IncrementalDetokenizer:
    """Per-sequence streaming detokenizer; owned by the sequence's output processor.

    Invariant: ``text`` is always the concatenation of every ``text_delta`` returned so far
    (plus what :meth:`finish` returned). After a stop string matched or :meth:`finish` was
    called, the detokenizer is finished and ``append`` raises ``RuntimeError``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: TextParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._matcher = StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        # Only the prompt's tail is ever decoded; keep just that as context.
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""  # decoded text held back (a stop string may still claim it)
        self._emitted: list[str] = []  # the deltas returned so far
        self._stop_str: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the returned deltas)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_str

    @property
    def finished(self) -> bool:
        return self._finished

    def append(self, token_ids: Sequence[int]) -> DetokenizerStep:
        """Add newly sampled token ids (one step's worth, or several) and return the delta.

        Pass every output token, including a final EOS or stop token id; special tokens are
        dropped from the text when ``params.skip_special_tokens`` is set.
        """
        if self._finished:
            raise RuntimeError("append() called on a finished detokenizer")
        if not token_ids:
            return DetokenizerStep("", None)
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._trim_ids()
        return self._emit(delta, final=False)

    def finish(self) -> str:
        """Flush held-back text when the sequence ends for another reason (EOS, length, abort).

        A trailing incomplete UTF-8 sequence is emitted as U+FFFD, exactly as a full
        ``tokenizer.decode`` of the output shows it. Text held back as a possible stop-string
        prefix is emitted; if the flushed tail completes a stop string, the output is still cut
        there and :attr:`stop_str` is set. Returns the final delta; idempotent.
        """
        if self._finished:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(new_text[len(prefix_text) :], final=True).text_delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _trim_ids(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them to keep memory bounded.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _emit(self, new: str, *, final: bool) -> DetokenizerStep:
        """Cut at a completed stop string, else release all text that cannot start one.

        A match always starts in the held-back text or in ``new``: everything emitted earlier
        was, when emitted, not a prefix of any stop string.
        """
        buf = self._pending + new
        hit = self._matcher.feed(new) if self._matcher is not None and new else None
        if hit is not None:
            end, s = hit
            upto = len(self._pending) + end
            delta = buf[:upto] if self._include_stop else buf[: upto - len(s)]
            self._stop_str = s
            self._finished = True
            self._pending = ""
            return self._out(delta, s)
        keep = 0 if final or self._matcher is None else self._matcher.holdback
        safe = len(buf) - keep
        self._pending = buf[safe:]
        self._finished = final
        return self._out(buf[:safe], None)

    def _out(self, delta: str, stop: str | None) -> DetokenizerStep:
        if delta:
            self._emitted.append(delta)
        return DetokenizerStep(delta, stop)
