"""The sticky-session oracle: the prefix-cache hits a worker that kept every session's history
(and evicted nothing) would have, computed from a run's own transcript."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from prefix_bench.workload import TurnResult


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sticky_hit_tokens(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Tokens of ``prompt`` a worker that computed every sequence in ``earlier`` (and evicted
    nothing) serves from its prefix cache: full blocks only, at least one token left to compute."""
    cap = (len(prompt) - 1) // block_size * block_size
    best = max((common_prefix_len(seq, prompt) for seq in earlier), default=0)
    return min(best // block_size * block_size, cap)


@dataclass(slots=True, frozen=True)
class OracleReport:
    prompt_tokens: int
    hit_tokens: int
    prompt_token_mismatches: int  # turns whose tokenized prompt length differs from usage
    reply_roundtrip_failures: int  # replies that do not tokenize back to completion_tokens ids
    per_turn_hits: tuple[int, ...]  # in the order of the results given

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def sticky_oracle(results: list[TurnResult], tokenizer: Any, block_size: int) -> OracleReport:
    """The sticky-session hit rate of this run's own transcript (``results`` sorted by session,
    turn). Tokenizes exactly as the router does: chat template to text, then no special tokens."""
    computed: dict[int, list[list[int]]] = collections.defaultdict(list)
    total = hits = mismatches = roundtrip = 0
    per_turn: list[int] = []
    for r in results:
        text = tokenizer.apply_chat_template(
            [{"role": ro, "content": c} for ro, c in r.messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        reply = list(tokenizer.encode(r.reply, add_special_tokens=False))
        mismatches += len(prompt) != r.prompt_tokens
        roundtrip += len(reply) != r.completion_tokens
        total += len(prompt)
        per_turn.append(sticky_hit_tokens(computed[r.session], prompt, block_size))
        hits += per_turn[-1]
        computed[r.session].append(prompt + reply[:-1])
    return OracleReport(total, hits, mismatches, roundtrip, tuple(per_turn))
