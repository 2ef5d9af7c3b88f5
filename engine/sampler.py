"""The sampler: turns one step's logits into one token per sequence (DESIGN.md §3).

Called by the ModelRunner once per step with the logits of every sequence that needs a token and
one :class:`SamplingRow` per logits row. It returns plain Python values; it keeps no state between
steps, so the caller owns all per-request state, including each request's ``torch.Generator``.

Pipeline, per row:

1. Penalties on float32 logits. Repetition penalty (HF/vLLM style) over prompt + output tokens:
   a positive logit is divided by the penalty, a negative one multiplied. Then presence and
   frequency penalties (OpenAI's definition) over output tokens only:
   ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``.
2. Logprobs, when asked for, are ``log_softmax`` of the *penalized* logits, before temperature,
   top-k, top-p and min-p: they describe the model (plus penalties), not the sampling filters.
3. Greedy rows (``SamplingParams.greedy``) take ``argmax``; ties go to the lowest token id.
4. Other rows: divide by temperature, then top-k, top-p, min-p, and sample from what is left.
   Tokens tied with the k-th largest logit survive top-k. top-p keeps the smallest prefix of the
   descending-probability order whose mass reaches ``top_p`` (at least one token; equal
   probabilities ordered by token id), renormalized after top-k. min-p drops tokens with
   probability < ``min_p * max_probability``, computed after top-k and top-p.

Sampling uses the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. picks token
``t`` with probability ``p[t]``. A row with a generator draws its ``V`` exponentials from that
generator alone, so a seeded request yields the same tokens whatever else shares the batch.
Rows without a generator draw from torch's global RNG on the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.kernels import cpu_ops
from tandem.kernels.refs import argmax_ref


@dataclass(slots=True)
class SamplingRow:
    """One logits row's sampling context, rebuilt by the ModelRunner every step.

    ``generator`` is the request's own generator (seeded requests) or None. It may live on the
    CPU or on the logits' device; the draw happens on the generator's device, so keeping it on
    the logits' device avoids a copy. The sampler advances it; the caller keeps owning it.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the ``params.logprobs`` most likely alternatives.

    ``rank`` is 1 + the number of tokens with a strictly larger logprob (the most likely token
    has rank 1). ``top`` is sorted by descending logprob; the order among exactly tied
    alternatives is unspecified.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row's params asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, ties to the lowest id. float32 logits on the CPU take the CPU kernel:
    torch's argmax read ~1 G elements/s here (0.5 ms a step at 128 rows of 4096 tokens)."""
    fit = logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(-1) == 1
    if fit and logits.is_cpu and logits.dtype is torch.float32 and cpu_ops.available():
        return cpu_ops.cpu_argmax(logits)
    return argmax_ref(logits)


class Sampler:
    """Stateless; one instance can serve every step of an engine."""

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Argmax per row of ``logits`` [B, V] (ties to the lowest id): the whole of sampling when
        :func:`argmax_only` holds, which the ModelRunner checks before building any rows."""
        return _argmax(logits).tolist()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]`` (any float dtype)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [{len(rows)}, vocab], got {list(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])

        params = [row.params for row in rows]
        if argmax_only(params):
            # Converting to float32 cannot change the argmax, so skip the copy.
            return SamplerOutput(token_ids=_argmax(logits).tolist(), logprobs=[None] * len(rows))
        penalized = [_has_penalties(p) for p in params]
        want_logprobs = [p.logprobs is not None for p in params]

        logits = logits.to(torch.float32, copy=True)
        if any(penalized):
            idx = [i for i, flag in enumerate(penalized) if flag]
            logits[idx] = apply_penalties(logits[idx], [rows[i] for i in idx])

        logprobs_all = logits.log_softmax(dim=-1) if any(want_logprobs) else None

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy_idx = [i for i, p in enumerate(params) if p.greedy]
        random_idx = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_idx:
            tokens[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
        if random_idx:
            tokens[random_idx] = _sample_random(logits[random_idx], [rows[i] for i in random_idx])

        token_list: list[int] = tokens.tolist()
        out_logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if logprobs_all is not None:
            lp_idx = [i for i, flag in enumerate(want_logprobs) if flag]
            lp_params = [params[i] for i in lp_idx]
            entries = _gather_logprobs(logprobs_all[lp_idx], tokens[lp_idx], lp_params)
            for i, entry in zip(lp_idx, entries, strict=True):
                out_logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=out_logprobs)


def argmax_only(params: Sequence[SamplingParams]) -> bool:
    """True when every row is greedy without penalties or logprobs: sampling is then one argmax
    (callers such as the ModelRunner may skip building SamplingRows altogether)."""
    return all(p.greedy and p.logprobs is None and not _has_penalties(p) for p in params)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _padded_ids(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``[len(seqs), max_len]`` long tensor, padded with ``pad``; built on CPU, copied once."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out.to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return float32 ``logits`` ``[R, V]`` with each row's penalties applied (see module doc).

    Token ids outside ``[0, V)`` raise ``ValueError`` rather than corrupting other rows.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    for row in rows:
        for ids in (row.prompt_token_ids, row.output_token_ids):
            if len(ids) and (min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
    # Column `vocab` collects the padding and is dropped.
    out_ids = _padded_ids([r.output_token_ids for r in rows], vocab, device)
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    prompt_ids = _padded_ids([r.prompt_token_ids for r in rows], vocab, device)
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device).unsqueeze(1)

    rep = column([r.params.repetition_penalty for r in rows])
    freq = column([r.params.frequency_penalty for r in rows])
    pres = column([r.params.presence_penalty for r in rows])
    scale = torch.where(seen, rep, torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - freq * counts - pres * (counts > 0).to(torch.float32)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask filtered tokens of ``logits`` ``[R, V]`` to ``-inf``.

    ``top_k`` ``[R]`` long in ``[0, V]`` (0 disables), ``top_p`` ``[R]`` float in ``(0, 1]``
    (1 disables); either may be None when no row uses it.
    """
    neg_inf = float("-inf")
    if top_p is None:
        if top_k is None:
            return logits
        # Without top-p no full sort is needed: the k-th value comes from topk(max k).
        top = logits.topk(int(top_k.max()), dim=-1).values
        return logits.masked_fill(logits < _kth_value(top, top_k), neg_inf)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = _kth_value(sorted_logits, top_k)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    # Rows with top_p == 1 keep everything: rounding could push mass_before past 1.0.
    drop &= (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _kth_value(descending: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` k-th largest value per row from descending-sorted values; -inf where k == 0."""
    kth = descending.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    return kth.masked_fill((top_k == 0).unsqueeze(1), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * max_probability`` (``min_p`` ``[R]``)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device)
    logits = logits / temps.unsqueeze(1)

    top_k = top_p = None
    if any(p.top_k > 0 for p in params):
        k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        top_k = torch.tensor(k, dtype=torch.long).to(device)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(device)
        logits = apply_min_p(logits, min_p)

    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            g = row.generator
            q[i] = torch.empty(vocab, device=g.device).exponential_(generator=g).to(device)
    # A zero-probability token must never win, even if its draw q is exactly 0 (0/0 = nan).
    score = torch.where(probs > 0, probs / q, torch.full_like(probs, -1.0))
    return score.argmax(dim=-1)


def _gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs]:
    """Chosen logprob, rank and top-N for each row, with one device-to-host copy per tensor."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    max_n = max(p.logprobs or 0 for p in params)
    top_vals: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if max_n > 0:
        top = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    result = []
    for i, (token, lp, rank) in enumerate(
        zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(), strict=True)
    ):
        n = params[i].logprobs or 0
        top_list = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        result.append(TokenLogprobs(token_id=token, logprob=lp, rank=rank, top=top_list))
    return result
