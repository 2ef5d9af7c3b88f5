"""Placement: which worker of a pool serves a request, and whether decode prefills locally.

Pure logic, called by ``flow.py`` once per pool per choice with ``Candidate`` snapshots built from
the registry and the prefix index. The prefix-aware score follows Dynamo's KV router and llm-d's
precise prefix-cache scorer: reward the fraction of the prompt's blocks a worker already caches,
penalize its load. Ties rotate (round-robin among the best) so equal workers share traffic.

    load  = kv_usage + (max(running + waiting, inflight) + waiting) / load_scale
    hit   = overlap_blocks + host_hit_weight * host_overlap_blocks
    score = prefix_weight * hit / min(request_blocks, prefix_unit_blocks)
            - load_weight * load

``overlap_blocks`` are the leading prompt blocks the worker holds in its device pool,
``host_overlap_blocks`` those its host KV tier continues with (``PrefixIndex.tiered_overlap``). A
host hit is worth ``host_hit_weight`` (0.5) of a device hit: it saves the prefill's compute, but
the blocks must first be copied back (and may be evicted from host memory sooner), so at equal
load a device hit beats a host hit of the same length, which beats a miss. The weight is below 1
so a worker holding a prefix on its device is preferred to one that must load it; it is well
above 0 because on every machine measured a host load costs a small fraction of recomputing
(benchmarks/kv_tier.py).

``inflight`` is the router's own count of requests it has sent there; it covers the up-to-a-second
lag of heartbeats. Waiting requests count twice: they still need their prefill.

The prefix term is the cached fraction of the prompt for prompts up to ``prefix_unit_blocks``; for
longer prompts it counts cached blocks in units of ``prefix_unit_blocks``. Prefill work grows with
the prompt while a queued request's cost does not, so a long cached history (multi-turn chat) must
outweigh more queued requests than a short one: without this a session whose worker had 3 more
requests in flight moved and recomputed its whole history (benchmarks/prefix_routing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


class Policy(IntEnum):
    PREFIX_AWARE = 1
    LEAST_LOAD = 2
    ROUND_ROBIN = 3

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, value: str) -> Policy:
        key = value.strip().upper().replace("-", "_")
        if key not in cls.__members__:
            names = ", ".join(p.label for p in cls)
            raise ValueError(f"unknown placement policy {value!r}; choose one of {names}")
        return cls[key]


@dataclass(slots=True, frozen=True)
class Candidate:
    engine_id: str
    overlap_blocks: int
    request_blocks: int
    running: int
    waiting: int
    kv_usage: float
    inflight: int
    host_overlap_blocks: int = 0


@dataclass(slots=True, frozen=True)
class Weights:
    prefix_weight: float = 1.0
    load_weight: float = 1.0
    load_scale: float = 4.0
    prefix_unit_blocks: int = 16
    host_hit_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.prefix_unit_blocks < 1:
            raise ValueError(f"prefix_unit_blocks must be >= 1, got {self.prefix_unit_blocks}")
        if not 0.0 <= self.host_hit_weight <= 1.0:
            raise ValueError(f"host_hit_weight must be in [0, 1], got {self.host_hit_weight}")


@dataclass(slots=True, frozen=True)
class Choice:
    engine_id: str
    overlap_blocks: int
    reason: str  # label of tandem_router_placements_total
    host_overlap_blocks: int = 0

    @property
    def cached_blocks(self) -> int:
        """Prompt blocks the chosen worker need not compute (device and host hits)."""
        return self.overlap_blocks + self.host_overlap_blocks


class PrefillMode(IntEnum):
    REMOTE = 1
    LOCAL = 2


@dataclass(slots=True, frozen=True)
class PrefillDecision:
    mode: PrefillMode
    reason: str


def load_of(c: Candidate, weights: Weights) -> float:
    requests = max(c.running + c.waiting, c.inflight) + c.waiting
    return c.kv_usage + requests / weights.load_scale


def score_of(c: Candidate, weights: Weights) -> float:
    unit = min(c.request_blocks, weights.prefix_unit_blocks)
    hit = c.overlap_blocks + weights.host_hit_weight * c.host_overlap_blocks
    ratio = hit / unit if unit > 0 else 0.0
    return weights.prefix_weight * ratio - weights.load_weight * load_of(c, weights)


class Placer:
    """Chooses a worker per pool. Holds only the per-pool rotation counters."""

    def __init__(self, policy: Policy, weights: Weights | None = None) -> None:
        self.policy = policy
        self.weights = weights or Weights()
        self._counters: dict[str, int] = {}

    def choose(self, pool: str, candidates: Sequence[Candidate]) -> Choice:
        """Pick one of ``candidates`` (non-empty, in a stable order) for ``pool``."""
        if not candidates:
            raise ValueError(f"no candidates in pool {pool}")
        turn = self._counters.get(pool, 0)
        self._counters[pool] = turn + 1
        if self.policy is Policy.ROUND_ROBIN:
            c = candidates[turn % len(candidates)]
            return Choice(c.engine_id, c.overlap_blocks, "round_robin", c.host_overlap_blocks)
        if self.policy is Policy.LEAST_LOAD:
            keys = [-load_of(c, self.weights) for c in candidates]
        else:
            keys = [score_of(c, self.weights) for c in candidates]
        best_key = max(keys)
        best = [c for c, k in zip(candidates, keys, strict=True) if k >= best_key - 1e-12]
        c = best[turn % len(best)]
        if self.policy is Policy.LEAST_LOAD:
            reason = "least_load"
        elif c.overlap_blocks > 0:
            reason = "prefix_hit"
        else:
            reason = "host_hit" if c.host_overlap_blocks > 0 else "load"
        return Choice(c.engine_id, c.overlap_blocks, reason, c.host_overlap_blocks)


def decide_prefill(
    *,
    prompt_tokens: int,
    decode_cached_tokens: int,
    threshold_tokens: int,
    decode_is_colocated: bool,
    prefill_available: bool,
    prefill_min_queue: int = 0,
    overload_queue: int = 0,
    prefill_incompatible: bool = False,
) -> PrefillDecision:
    """Conditional disaggregation: prefill on the decode worker or on a prefill worker.

    ``threshold_tokens`` 0 means always use a prefill worker when one is available.
    ``prefill_min_queue`` is the shortest queue (waiting + in flight) among prefill workers; when
    it reaches ``overload_queue`` (> 0) the whole prefill pool is overloaded and waiting there
    would cost more TTFT than prefilling on the decode worker. ``prefill_incompatible``: prefill
    workers exist but none shares the decode's fingerprint (a rollout half done, another
    checkpoint under the same name), so their KV would be garbage here.
    """
    if decode_is_colocated:
        return PrefillDecision(PrefillMode.LOCAL, "colocated")
    if not prefill_available:
        reason = "incompatible" if prefill_incompatible else "local_no_prefill_worker"
        return PrefillDecision(PrefillMode.LOCAL, reason)
    if overload_queue > 0 and prefill_min_queue >= overload_queue:
        return PrefillDecision(PrefillMode.LOCAL, "local_prefill_overloaded")
    uncached = prompt_tokens - decode_cached_tokens
    if threshold_tokens > 0 and uncached < threshold_tokens:
        return PrefillDecision(PrefillMode.LOCAL, "local_below_threshold")
    return PrefillDecision(PrefillMode.REMOTE, "remote")


@dataclass(slots=True, frozen=True)
class PeerSource:
    """A worker that could serve a prefix pull: ``blocks`` leading prompt blocks on its device."""

    engine_id: str
    blocks: int


def choose_pull_source(
    *,
    chosen_cached_blocks: int,
    sources: Sequence[PeerSource],
    usable_blocks: int,
    block_size: int,
    min_tokens: int,
) -> PeerSource | None:
    """Prefix pull from a peer: the source whose device holds the longest prefix of the prompt,
    if that is at least ``min_tokens`` more than the chosen worker already caches (device and
    host). ``usable_blocks`` is the most a pull may bring, (prompt - 1) // block_size: one
    token is always computed. ``min_tokens`` 0 turns pulls off. Ties go to the first source
    (callers pass a stable order). The source's blocks are capped at ``usable_blocks``."""
    if min_tokens <= 0:
        return None
    best: PeerSource | None = None
    for s in sources:
        blocks = min(s.blocks, usable_blocks)
        if best is None or blocks > best.blocks:
            best = PeerSource(s.engine_id, blocks)
    if best is None or (best.blocks - chosen_cached_blocks) * block_size < min_tokens:
        return None
    return best
