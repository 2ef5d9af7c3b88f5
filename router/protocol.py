"""OpenAI request models and their validation into OpenAIError (400, naming the parameter).

Called by the app's handlers with the parsed JSON body. Models are strict (``"0.5"`` is not a
float, ``true`` is not an int) and ignore unknown fields, as the official clients send extras.
Ranges follow OpenAI, plus the vLLM extensions users expect (top_k, min_p, repetition_penalty,
ignore_eos, ...).
``to_sampling_dict`` produces the wire form of the engine's SamplingParams (docs/internal-api.md).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.engine.request_limits import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    LimitError,
    check_choices,
    check_stop,
    check_stop_token_ids,
)
from tandem.router.errors import OpenAIError, bad_request

M = TypeVar("M", bound=BaseModel)

__all__ = ["MAX_LOGPROBS", "MAX_N", "MAX_STOP_STRINGS"]  # re-exported: one definition of each

# apply_chat_template's own parameters: passing them as "template kwargs" would change what is
# rendered (another template, tokenized output, tools) instead of setting a template variable.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "conversation", "messages",
})  # fmt: skip
MAX_TEMPLATE_KWARGS = 8
MAX_TEMPLATE_KWARG_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Strict):
    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        try:
            check_stop(items)
        except LimitError as exc:
            raise ValueError(exc.message) from None
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            try:
                check_stop_token_ids(v)
            except LimitError as exc:
                raise ValueError(exc.message) from None
            if any(t < 0 for t in v):
                raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise _ParamError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_dict(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """The engine's SamplingParams wire form for one choice (n is fanned out by the router)."""
        return {
            "n": 1,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": (
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            "max_tokens": max_tokens,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
        }


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("prompt token lists must not be empty")
            if isinstance(v[0], int) and any(t < 0 for t in v):
                raise ValueError("prompt token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        try:
            check_choices(len(self.prompts()), self.n)
        except LimitError as exc:
            raise _ParamError(exc.param, exc.message) from None
        if self.echo:
            raise _ParamError("echo", "echo is not supported")
        if self.suffix is not None:
            raise _ParamError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _ParamError("best_of", "best_of must equal n (or be omitted)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids given directly."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Template variables only (e.g. ``enable_thinking``): scalar values, a few of them,
        never the renderer's own parameters (another template, tokenize, tools, ...)."""
        if not v:
            return v
        if len(v) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs are allowed")
        for key, value in v.items():
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{key!r} may not be set through chat_template_kwargs")
            if not key.isidentifier() or key.startswith("_"):
                raise ValueError(f"{key!r} is not a template variable name")
            if value is not None and not isinstance(value, bool | int | float | str):
                raise ValueError(f"{key!r} must be a boolean, number, string or null")
            if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
                raise ValueError(f"{key!r} may be at most {MAX_TEMPLATE_KWARG_CHARS} characters")
        return v

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the current name; max_tokens the deprecated one.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _ParamError(ValueError):
    """Raised inside a model validator to name a specific parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def parse_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode a request body; 413 when oversized, 400 when not a JSON object."""
    if len(raw) > max_bytes:
        raise OpenAIError(
            413, f"Request body is {len(raw)} bytes; the limit is {max_bytes}.", code="too_large"
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    """Validate a parsed body; the first problem becomes a 400 naming its parameter."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _ParamError):
            raise bad_request(ctx_error.message, param=ctx_error.param) from None
        loc = [str(p) for p in err["loc"]]
        # Union members add their type name to the location; keep only the path the user wrote.
        path = [p for p in loc if not _is_type_tag(p)]
        param = ".".join(path) if path else None
        if err["type"] == "missing":
            raise bad_request(
                f"Missing required parameter: '{param}'.",
                param=param,
                code="missing_required_parameter",
            ) from None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(
            f"Invalid value for '{param}': {msg}" if param else msg,
            param=param,
            code="invalid_value",
        ) from None


def _is_type_tag(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "none")
        or part.startswith(("list[", "dict[", "function-", "literal["))
        or part in ("TextPart", "StreamOptions", "ChatMessage")
    )
