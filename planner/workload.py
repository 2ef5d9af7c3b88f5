"""Workloads: when requests arrive, how long their prompts and answers are, what they share.

``generate(workload, token_ids, seed)`` is deterministic in its arguments (its own
``random.Random``). Arrivals are Poisson (exponential gaps), constant (evenly spaced, as
guidellm's ``constant`` profile) or gamma with a coefficient of variation (bursty). Lengths are
fixed or drawn around their mean (uniform within +-spread, or a normal clipped to [1, ...]).
Prefix sharing: ``prefix_share`` of each prompt's tokens is one of ``prefix_groups`` shared
prefixes (a system prompt, a document), the rest is fresh.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


class Arrival(IntEnum):
    POISSON = 1
    CONSTANT = 2
    GAMMA = 3

    @classmethod
    def parse(cls, value: str) -> Arrival:
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"arrival must be poisson, constant or gamma; got {value!r}") from None


class Spread(IntEnum):
    FIXED = 1
    UNIFORM = 2
    NORMAL = 3


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token counts: ``mean``, and ``spread`` as a fraction of it (0: fixed)."""

    mean: int
    spread: float = 0.0
    kind: Spread = Spread.UNIFORM

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"a mean length must be >= 1, got {self.mean}")
        if not 0 <= self.spread <= 1:
            raise ValueError(f"a length spread must be in [0, 1], got {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if self.spread == 0 or self.kind is Spread.FIXED:
            return self.mean
        if self.kind is Spread.UNIFORM:
            lo = max(1, round(self.mean * (1 - self.spread)))
            return rng.randint(lo, round(self.mean * (1 + self.spread)))
        return max(1, round(rng.gauss(self.mean, self.mean * self.spread)))


@dataclass(frozen=True, slots=True)
class Workload:
    rate: float  # requests per second
    isl: Lengths
    osl: Lengths
    num_requests: int = 1000
    arrival: Arrival = Arrival.POISSON
    burstiness_cv: float = 2.0  # gamma arrivals only: coefficient of variation of the gaps
    prefix_share: float = 0.0
    prefix_groups: int = 1

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"prefix_share must be in [0, 1), got {self.prefix_share}")
        if self.prefix_groups < 1:
            raise ValueError(f"prefix_groups must be >= 1, got {self.prefix_groups}")
        if not self.burstiness_cv > 0:
            raise ValueError(f"burstiness_cv must be > 0, got {self.burstiness_cv}")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    arrival: float  # seconds from the start
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _gaps(w: Workload, rng: random.Random) -> list[float]:
    mean = 1.0 / w.rate
    if w.arrival is Arrival.CONSTANT:
        return [mean] * w.num_requests
    if w.arrival is Arrival.POISSON:
        return [rng.expovariate(w.rate) for _ in range(w.num_requests)]
    shape = 1.0 / (w.burstiness_cv**2)
    return [rng.gammavariate(shape, mean / shape) for _ in range(w.num_requests)]


def generate(
    w: Workload, token_ids: Sequence[int], seed: int, max_model_len: int
) -> list[WorkloadRequest]:
    """The requests of ``w``: prompts drawn from ``token_ids``; prompt + output fit the model
    (prompts longer than ``max_model_len - 1`` are cut, outputs cut to the room left)."""
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    rng = random.Random(seed)
    vocab = list(token_ids)
    prefixes = [
        tuple(rng.choices(vocab, k=round(w.isl.mean * w.prefix_share)))
        for _ in range(w.prefix_groups if w.prefix_share > 0 else 0)
    ]
    out = []
    t = 0.0
    for i, gap in enumerate(_gaps(w, rng)):
        t = t + gap if i else 0.0
        isl = min(w.isl.draw(rng), max_model_len - 1)
        prefix = prefixes[rng.randrange(len(prefixes))][:isl] if prefixes else ()
        prompt = prefix + tuple(rng.choices(vocab, k=isl - len(prefix)))
        osl = max(1, min(w.osl.draw(rng), max_model_len - isl))
        out.append(WorkloadRequest(t, prompt, osl))
    return out
