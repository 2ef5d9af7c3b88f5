"""Per-request sampling parameters (DESIGN.md §3), with the defaults vLLM users expect.

Built by the offline API (``tandem.LLM``), by the router from an OpenAI request, and by workers
from the ``sampling_params`` object of a ``GenerateRequest`` (docs/internal-api.md) through
:meth:`SamplingParams.from_dict`. Every constructor path validates, so an invalid instance is never
handed to the scheduler or the sampler; every error is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# Temperatures below this are treated as greedy, as vLLM does: dividing logits by a tiny
# temperature overflows float32 and the result is argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _type_name(value: object) -> str:
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    ``top_k`` of 0 or -1 disables top-k. ``logprobs`` is the number of top alternatives reported
    besides the chosen token (0: the chosen token only; None: no logprobs). ``stop`` accepts a
    single string, normalized to a one-element list. ``stop``, ``include_stop_str_in_output``
    and ``skip_special_tokens`` shape the text, which is made where output leaves the system
    (``output_processor.py``: the router, the offline ``LLM``); the engine's step ignores them.
    Integer values of float fields are normalized to float. Mutating an instance is allowed;
    call :meth:`validate` afterwards.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if _is_int(value):
                setattr(self, name, float(value))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field; never modifies the instance."""
        _check_int("n", self.n, minimum=1)
        for name in _FLOAT_FIELDS:
            _check_float(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=_INT64_MIN, maximum=_INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if not isinstance(self.stop, list):
            raise ValueError(
                f"stop must be a string or a list of strings, got {_type_name(self.stop)}"
            )
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}] must be a string, got {_type_name(s)}")
            if not s:
                raise ValueError(f"stop[{i}] must be a non-empty string")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of ints, got {_type_name(self.stop_token_ids)}"
            )
        for i, t in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", t, minimum=0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {_type_name(value)}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """JSON- and msgpack-safe wire form; :meth:`from_dict` inverts it exactly."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
        return out

    @classmethod
    def from_dict(cls, d: object) -> SamplingParams:
        """Build from an untrusted wire dict (workers receive it from the network).

        Missing keys take their defaults. Unknown keys and wrong types raise ``ValueError``
        naming the key.
        """
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {_type_name(d)}")
        for key in d:
            if key not in _FIELD_NAMES:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {_type_name(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {_type_name(value)} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
