"""OpenAI response shapes: streamed chunks (SSE) and whole responses, chat and completions.

A ``ResponseBuilder`` is made per request by the app's handler; it turns the flow's TokenEvents into
exactly what the official clients parse: for chat, a role delta first per choice, content deltas, a
finish chunk with an empty delta, then ``[DONE]``; with ``stream_options.include_usage`` every chunk
carries ``"usage": null`` and a last chunk with no choices carries the usage.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from tandem.router.choice_output import TokenEvent
from tandem.router.errors import OpenAIError
from tandem.router.tokenizer import PromptEncoder

DONE = b"data: [DONE]\n\n"


class Kind(IntEnum):
    CHAT = 1
    COMPLETION = 2


@dataclass(slots=True)
class ChoiceState:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)
    text_offset: int = 0


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ResponseBuilder:
    """Formats one request's output; also accumulates per-choice text and token counts."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        num_choices: int,
        prompt_tokens: int,
        encoder: PromptEncoder,
        *,
        logprobs: bool,
        include_usage: bool,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self._encoder = encoder
        self._logprobs = logprobs
        self._include_usage = include_usage

    # -- accounting -------------------------------------------------------------------------
    def absorb(self, ev: TokenEvent) -> None:
        c = self.choices[ev.choice]
        c.text.append(ev.text)
        c.num_tokens += len(ev.token_ids)
        if ev.finish_reason is not None:
            c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
        if self._logprobs and ev.logprobs:
            c.logprobs.extend(ev.logprobs)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self.choices)
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind is Kind.CHAT else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self._include_usage:
            obj["usage"] = None
        return obj

    def start_chunks(self) -> list[bytes]:
        if self.kind is not Kind.CHAT:
            return []
        return [
            sse(
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for i in range(len(self.choices))
        ]

    def event_chunks(self, ev: TokenEvent) -> list[bytes]:
        """Chunks for one event (after ``absorb``): content delta, then the finish chunk."""
        out: list[bytes] = []
        lp = self._format_logprobs(ev.choice, ev.logprobs) if self._logprobs else None
        if ev.text or lp is not None:
            if self.kind is Kind.CHAT:
                choice = {"index": ev.choice, "delta": {"content": ev.text}, "logprobs": lp,
                          "finish_reason": None}  # fmt: skip
            else:
                choice = {"index": ev.choice, "text": ev.text, "logprobs": lp,
                          "finish_reason": None}  # fmt: skip
            out.append(sse(self._chunk([choice])))
        if ev.finish_reason is not None:
            if self.kind is Kind.CHAT:
                final = {"index": ev.choice, "delta": {}, "logprobs": None,
                         "finish_reason": ev.finish_reason}  # fmt: skip
            else:
                final = {"index": ev.choice, "text": "", "logprobs": None,
                         "finish_reason": ev.finish_reason}  # fmt: skip
            final["stop_reason"] = ev.stop_reason
            out.append(sse(self._chunk([final])))
        return out

    def end_chunks(self) -> list[bytes]:
        out = []
        if self._include_usage:
            obj = self._chunk([])
            obj["usage"] = self.usage()
            out.append(sse(obj))
        out.append(DONE)
        return out

    @staticmethod
    def error_chunks(err: OpenAIError) -> list[bytes]:
        return [sse(err.body()), DONE]

    # -- whole response -----------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp = self._whole_logprobs(c) if self._logprobs else None
            if self.kind is Kind.CHAT:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind is Kind.CHAT else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # -- logprobs -----------------------------------------------------------------------------
    def _entries(self, raw: list[Any] | None) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Worker logprobs, one per token: {"token_id", "logprob", "top": [[id, logprob], ...]}."""
        out = []
        for item in raw or []:
            if not isinstance(item, dict):
                continue
            top = []
            for t in item.get("top") or []:
                if isinstance(t, dict):
                    top.append((int(t["token_id"]), float(t["logprob"])))
                else:
                    top.append((int(t[0]), float(t[1])))
            out.append((int(item["token_id"]), float(item["logprob"]), top))
        return out

    def _format_logprobs(self, choice: int, raw: list[Any] | None) -> dict[str, Any] | None:
        entries = self._entries(raw)
        if not entries:
            return None
        enc = self._encoder
        if self.kind is Kind.CHAT:
            return {
                "content": [
                    {
                        "token": enc.token_text(tid),
                        "logprob": lp,
                        "bytes": enc.token_bytes(tid),
                        "top_logprobs": [
                            {"token": enc.token_text(t), "logprob": tl, "bytes": enc.token_bytes(t)}
                            for t, tl in top
                        ],
                    }
                    for tid, lp, top in entries
                ],
                "refusal": None,
            }
        c = self.choices[choice]
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp, top in entries:
            s = enc.token_text(tid)
            tokens.append(s)
            token_lps.append(lp)
            tops.append({enc.token_text(t): tl for t, tl in top})
            offsets.append(c.text_offset)
            c.text_offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _whole_logprobs(self, c: ChoiceState) -> dict[str, Any] | None:
        idx = self.choices.index(c)
        c.text_offset = 0
        return self._format_logprobs(idx, c.logprobs)
