"""Incremental detokenizer with stop strings (DESIGN.md §3, "Output").

The engine creates one :class:`IncrementalDetokenizer` per output sequence and calls
:meth:`~IncrementalDetokenizer.append` with each step's new token ids, then streams
``text_delta`` to the client. Two things are held back from the stream:

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
with ``include_stop_str_in_output``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tandem.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True, frozen=True)
class DetokenizerStep:
    """What one ``append`` produced: text to stream, and the stop string if one matched.

    When ``stop_str`` is not None the request must finish with reason "stop"; ``text_delta`` is
    then the last text of the sequence (already cut).
    """

    text_delta: str
    stop_str: str | None


class IncrementalDetokenizer:
    """Per-sequence streaming detokenizer; owned by the engine's per-request output state.

    Invariant: ``text`` is always the concatenation of every ``text_delta`` returned so far
    (plus what :meth:`finish` returned). After a stop string matched or :meth:`finish` was
    called, the detokenizer is finished and ``append`` raises ``RuntimeError``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # Only the prompt's tail is ever decoded; keep just that as context.
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # complete decoded output text, before any stop cut
        self._text = ""  # text emitted so far
        self._stop_str: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the returned deltas)."""
        return self._text

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
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._decoded += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._trim_ids()
        return self._emit(final=False)

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
        self._decoded += new_text[len(prefix_text) :]
        return self._emit(final=True).text_delta

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

    def _emit(self, *, final: bool) -> DetokenizerStep:
        """Cut at a completed stop string, else release all text that cannot start one."""
        already = len(self._text)
        stop = self._find_stop(already)
        if stop is not None:
            start, s = stop
            end = start + len(s) if self._include_stop else start
            delta = self._decoded[already:end]
            self._text += delta
            self._stop_str = s
            self._finished = True
            return DetokenizerStep(delta, s)
        safe = len(self._decoded) if final else len(self._decoded) - self._stop_prefix_len()
        delta = self._decoded[already:safe]
        self._text += delta
        self._finished = final
        return DetokenizerStep(delta, None)

    def _find_stop(self, emitted: int) -> tuple[int, str] | None:
        """The first stop match to complete, searching only where a new match can lie."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stops:
            # Everything before `emitted` was checked already; a match may still start up to
            # len(s) - 1 characters before it, in the held-back or already-emitted text.
            idx = self._decoded.find(s, max(0, emitted - len(s) + 1))
            if idx < 0:
                continue
            key = (idx + len(s), -len(s), s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, neg_len, s = best
        return end + neg_len, s

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._decoded
        longest = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
