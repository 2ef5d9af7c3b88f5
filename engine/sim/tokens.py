"""The tokens a simulated worker emits: deterministic in the sequence so far, never EOS.

A prefill worker, a decode worker and the discrete-event simulator all compute the next token
from the same ids with ``next_token``, so disaggregated output equals colocated output and the
simulator's prefix hashes of generated blocks equal the workers'. Without EOS a request runs to
its ``max_tokens`` (or a stop condition), which is what a workload's output length means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput

_MASK = 0xFFFFFFFF


def next_token(token_ids: Sequence[int], choices: Sequence[int]) -> int:
    """FNV-style mix of the length and the last four ids; stable across processes."""
    h = (len(token_ids) * 0x9E3779B1) & _MASK
    for t in token_ids[-4:]:
        h = ((h ^ t) * 0x01000193) & _MASK
    return choices[h % len(choices)]


def sample(out: SchedulerOutput, choices: Sequence[int]) -> ModelRunnerOutput:
    """A simulated step's result: ``next_token`` for every row the scheduler samples, no
    logprobs (the simulated runner and the discrete-event simulator's workers both use it)."""
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.sample:
            req = s.request
            result.sampled_token_ids.append(next_token(req.all_token_ids, choices))
            result.logprobs[req.request_id] = None
    return result


def printable_token_ids(
    tokenizer: Any, vocab_size: int, exclude: frozenset[int], limit: int = 64
) -> tuple[int, ...]:
    """Up to ``limit`` ids that decode alone to one printable ASCII word character (letters and
    digits), so simulated text streams cleanly; falls back to any non-special id."""
    found: list[int] = []
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(exclude)
    for i in range(min(vocab_size, 4096)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if len(text) == 1 and text.isascii() and text.isalnum():
            found.append(i)
            if len(found) >= limit:
                break
    if not found:
        found = [i for i in range(min(vocab_size, limit + len(special))) if i not in special]
    if not found:
        raise ValueError("the tokenizer has no token a simulated worker could emit")
    return tuple(found[:limit])
