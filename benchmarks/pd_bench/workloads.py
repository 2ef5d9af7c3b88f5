"""The workloads, as guidellm data and profiles. Pure: no I/O but writing a trace file.

- ``prefill-heavy``: prompts uniform in 1-2 k tokens, outputs uniform in 64-256, Poisson
  arrivals swept over ``rates``;
- ``chat``: prompts and outputs normal around 256 (stdev 64, clipped to 128-384), Poisson
  arrivals swept over ``rates``.
  Each sweep point is a seeded trace (``poisson_trace``: Poisson gaps rescaled to the exact rate)
  that guidellm replays, synthesizing each prompt to its length (``trace_synthetic``).
- ``bursty``: a trace replayed by guidellm (``trace_synthetic`` + the ``replay`` profile): short
  background requests (32-token prompts, 240-token outputs, Poisson) plus a burst of
  ``burst_size`` long prompts every ``burst_every_s`` seconds; swept by scaling the whole trace's
  load (guidellm's ``time_scale`` = 1 / load). Load 1.0 is the fixed point below capacity, where
  the ITL canary's timeline through the bursts is reported.

Rates are for the default model (random Llama, hidden 384, 6 layers) on 2 CPU cores; scale them
to another machine with ``--rate-scale``. ``fixed`` is the sweep point "below capacity" whose
TTFT/ITL distributions are reported.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class Lengths:
    """A guidellm synthetic length distribution per side: normal(mean, stdev) clipped to
    [min, max], or uniform over [min, max] when stdev is None (guidellm's own rule)."""

    prompt: int
    prompt_stdev: int | None
    prompt_min: int
    prompt_max: int
    output: int
    output_stdev: int | None
    output_min: int
    output_max: int

    def data_arg(self) -> str:
        """The ``--data`` value of guidellm's ``synthetic_text`` source."""
        parts = ["kind=synthetic_text"]
        for side in ("prompt", "output"):
            parts.append(f"{side}_tokens={getattr(self, side)}")
            if getattr(self, f"{side}_stdev") is not None:
                parts.append(f"{side}_tokens_stdev={getattr(self, f'{side}_stdev')}")
            parts.append(f"{side}_tokens_min={getattr(self, f'{side}_min')}")
            parts.append(f"{side}_tokens_max={getattr(self, f'{side}_max')}")
        return ",".join(parts)


@dataclass(slots=True, frozen=True)
class Synthetic:
    name: str
    lengths: Lengths
    rates: tuple[float, ...]  # requests per second, ascending
    fixed: int  # index into rates: the point below capacity

    def scaled(self, scale: float) -> tuple[float, ...]:
        return tuple(round(r * scale, 4) for r in self.rates)


@dataclass(slots=True, frozen=True)
class Bursty:
    name: str
    background_rate: float  # short requests per second at load 1.0
    background_prompt: int
    background_output: int
    burst_every_s: float
    burst_size: int
    burst_prompt: int
    burst_output: int
    loads: tuple[float, ...]  # trace load multipliers, ascending; 1.0 must be one of them
    canary_streams: int  # closed-loop streams of background shape timed per chunk

    @property
    def fixed(self) -> int:
        return self.loads.index(1.0)

    def rate(self, load: float) -> float:
        """Offered requests per second at ``load``."""
        return load * (self.background_rate + self.burst_size / self.burst_every_s)


PREFILL_HEAVY = Synthetic(
    "prefill-heavy",
    Lengths(1536, None, 1024, 2048, 160, None, 64, 256),
    rates=(0.25, 0.4, 0.6, 0.9),
    fixed=1,
)
CHAT = Synthetic(
    "chat",
    Lengths(256, 64, 128, 384, 256, 64, 128, 384),
    rates=(0.75, 1.5, 2.25, 3.0),
    fixed=1,
)
BURSTY = Bursty(
    "bursty",
    background_rate=1.0,
    background_prompt=32,
    background_output=240,
    burst_every_s=6.0,
    burst_size=2,
    burst_prompt=1500,
    burst_output=16,
    loads=(0.6, 1.0, 1.4),
    canary_streams=2,
)
WORKLOADS: dict[str, Synthetic | Bursty] = {w.name: w for w in (PREFILL_HEAVY, CHAT, BURSTY)}

# The calibration runs (one request at a time): short prompts, then prompts across every
# workload's range, so the unloaded TTFT profile covers every length the SLOs judge; short outputs
# (ITL needs a few tokens).
CALIBRATION = (Lengths(32, None, 32, 32, 32, None, 32, 32),
               Lengths(1088, None, 128, 2048, 32, None, 32, 32))  # fmt: skip


# Positions of the default model: room for every workload's longest prompt plus its longest
# output (and the chat template's few tokens); ``longest_request`` is what must fit.
MODEL_CONTEXT = 4096


def longest_request() -> int:
    """The most positions one request of any workload or calibration can take."""
    spans = [ls.prompt_max + ls.output_max for ls in CALIBRATION]
    for w in WORKLOADS.values():
        if isinstance(w, Synthetic):
            spans.append(w.lengths.prompt_max + w.lengths.output_max)
        else:
            spans.append(max(w.background_prompt + w.background_output,
                             w.burst_prompt + w.burst_output))  # fmt: skip
    return max(spans)


def bursty_trace(w: Bursty, duration_s: float, seed: int) -> list[dict[str, float | int]]:
    """The bursty trace at load 1.0 for ``duration_s`` seconds: rows of guidellm's
    ``trace_synthetic`` format (timestamp s, input_length, output_length), by timestamp. The first
    burst comes at a quarter period, so even a short run sees one."""
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    rng = random.Random(seed)
    rows: list[dict[str, float | int]] = []
    t = rng.expovariate(w.background_rate)
    while t < duration_s:
        rows.append({"timestamp": round(t, 4), "input_length": w.background_prompt,
                     "output_length": w.background_output})  # fmt: skip
        t += rng.expovariate(w.background_rate)
    b = w.burst_every_s / 4
    while b < duration_s:
        rows += [{"timestamp": round(b, 4), "input_length": w.burst_prompt,
                  "output_length": w.burst_output} for _ in range(w.burst_size)]  # fmt: skip
        b += w.burst_every_s
    return sorted(rows, key=lambda r: r["timestamp"])


def draw_length(rng: random.Random, mean: int, stdev: int | None, lo: int, hi: int) -> int:
    """One length of a ``Lengths`` side: uniform over [lo, hi] without a stdev, else a clipped,
    rounded normal (guidellm's synthetic_text rule)."""
    if stdev is None:
        return rng.randint(lo, hi)
    return min(hi, max(lo, round(rng.gauss(mean, stdev))))


def poisson_trace(lengths: Lengths, rate: float, n: int, seed: int) -> list[dict[str, float | int]]:
    """``n`` requests with Poisson arrivals at ``rate`` per second, as guidellm trace rows. The
    exponential gaps are rescaled so that the n gaps (the last one ends the window) add up to
    exactly ``n / rate``: with the 8-20 requests of one sweep point a raw Poisson sample's rate is
    often off by 2x (guidellm's own ``poisson`` profile also draws the same gaps in each of its
    worker processes), and a point must offer the load it is labelled with. Lengths are drawn
    from ``lengths``; the same seed gives every deployment the same trace."""
    if rate <= 0 or n < 1:
        raise ValueError("a Poisson trace needs rate > 0 and n >= 1")
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    scale = n / rate / sum(gaps)
    rows: list[dict[str, float | int]] = []
    t = 0.0
    for g in gaps:
        rows.append({
            "timestamp": round(t, 4),
            "input_length": draw_length(rng, lengths.prompt, lengths.prompt_stdev,
                                        lengths.prompt_min, lengths.prompt_max),
            "output_length": draw_length(rng, lengths.output, lengths.output_stdev,
                                         lengths.output_min, lengths.output_max),
        })  # fmt: skip
        t += g * scale
    return rows


def write_trace(rows: list[dict[str, float | int]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
