"""Continuing a sequence that another worker started (a decode taking over from a prefill's first
token; a stream migrated after its worker failed).

``continue_sequence`` makes the tokens already generated (and already delivered to the client)
the request's first outputs: they count toward ``max_tokens``, penalties and stop checks exactly
as if generated here, and only the tokens after them are streamed. The request then prefills
prompt + those tokens (prefix-cache hits included) and samples on.

Seeded sampling continues exactly where the draws are reproducible: the sampler's exponential
race draws exactly ``vocab`` numbers from a seeded request's generator per sampled token (see
``sampler._sample_random``), and a CPU generator advanced by one draw of ``n * vocab`` numbers is
in the same state as after ``n`` draws of ``vocab``, so the generator is fast-forwarded by the
tokens already sampled elsewhere. That holds for CPU generators only; on CUDA, and beyond
``MAX_FAST_FORWARD_DRAWS`` numbers, the sequence continues from the seed's fresh state and its
later tokens differ from an uninterrupted run (docs/reliability.md says so). Greedy requests draw
nothing and always continue exactly (up to the floating-point difference between recomputed and
incrementally computed KV, as for prefill/decode against colocated).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem.engine.request import Request

log = logging.getLogger(__name__)

MAX_FAST_FORWARD_DRAWS = 1 << 24  # ~0.1 s of CPU draws; beyond it the continuation is inexact


def continue_sequence(req: Request, token_ids: Sequence[int], vocab_size: int) -> bool:
    """Append ``token_ids`` as already-generated outputs of a request not yet queued; raises
    ValueError (request unchanged) when they do not fit. Returns False when seeded sampling
    could not be fast-forwarded (the continuation is then not the uninterrupted one)."""
    if req.num_output_tokens:
        raise ValueError("the request already has output tokens")
    bad = next((t for t in token_ids if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"generated token id {bad!r} is out of range [0, {vocab_size})")
    if len(token_ids) >= req.max_tokens:
        raise ValueError(
            f"{len(token_ids)} generated tokens already reach max_tokens ({req.max_tokens})"
        )
    for t in token_ids:
        req.append_output_token(t)
    return fast_forward(req, len(token_ids), vocab_size)


def fast_forward(req: Request, num_sampled: int, vocab_size: int) -> bool:
    """Advance a seeded request's generator past ``num_sampled`` sampled tokens."""
    g = req.generator
    if g is None or req.params.greedy or num_sampled == 0:
        return True
    draws = num_sampled * vocab_size
    if g.device.type != "cpu" or draws > MAX_FAST_FORWARD_DRAWS:
        # Debug, not info: on CUDA every seeded P->D request passes here (the prefill's token).
        log.debug(
            "request %s: seeded sampling continues from a fresh generator (%d tokens on %s)",
            req.request_id, num_sampled, g.device.type,
        )  # fmt: skip
        return False
    torch.empty(draws, device=g.device).exponential_(generator=g)
    return True
