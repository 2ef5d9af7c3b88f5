"""Kernel 7: token sampling from logits.

Greedy decoding is a Triton argmax kernel (one program per row, first index of the maximum, like
torch.argmax). Top-k/top-p sampling is a PyTorch path, by choice: a row's draw must depend only on
that request's torch.Generator so that a seeded request gives the same tokens on every backend, in
every batch, on prefill and decode workers alike. Triton's Philox (tl.rand) cannot consume a
torch.Generator's stream, and the sort/cumsum here is tiny next to a forward pass.

Called by the engine's sampler once per step with the rows that need a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch import FLOAT_DTYPES, check_dtype, check_launchable, check_shape


@triton.jit
def _greedy_sample_kernel(
    logits_ptr,
    out_ptr,
    stride_row,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    best_val = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    best_idx = tl.sum(tl.zeros([BLOCK_V], tl.int64), 0)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        chunk_max = tl.max(x, 0)
        # First index holding the chunk's maximum; a later chunk wins only if strictly larger.
        chunk_idx = tl.min(tl.where(x == chunk_max, idx, vocab), 0).to(tl.int64)
        better = chunk_max > best_val
        best_idx = tl.where(better, chunk_idx, best_idx)
        best_val = tl.where(better, chunk_max, best_val)
    tl.store(out_ptr + row, best_idx)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Argmax token per row of logits [B, V] -> int64 [B] (first index on ties).

    Rows whose logits are all -inf (or NaN) yield 0.
    """
    name = "greedy_sample"
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{name}: logits must be [B, V] with V > 0, got {tuple(logits.shape)}")
    check_dtype(name, "logits", logits, FLOAT_DTYPES)
    if logits.stride(1) != 1:
        raise ValueError(f"{name}: logits must have stride 1 in the vocabulary dimension")
    check_launchable(name, logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    block_v = min(4096, triton.next_power_of_2(logits.shape[1]))
    _greedy_sample_kernel[(logits.shape[0],)](
        logits, out, logits.stride(0), logits.shape[1], BLOCK_V=block_v
    )
    return out


def greedy_sample_ref(logits: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`greedy_sample`."""
    return torch.argmax(logits, dim=-1)


def _check_sampling_args(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> None:
    name = "top_k_top_p_sample"
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{name}: logits must be [B, V] with V > 0, got {tuple(logits.shape)}")
    batch = logits.shape[0]
    check_dtype(name, "logits", logits, FLOAT_DTYPES)
    for what, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        check_shape(name, what, t, (batch,))
        if t.device != logits.device:
            raise ValueError(f"{name}: {what} is on {t.device}, logits on {logits.device}")
    check_dtype(name, "top_k", top_k, (torch.int32, torch.int64))
    if len(generators) != batch:
        raise ValueError(f"{name}: need one generator (or None) per row, got {len(generators)}")
    if bool((temperature < 0).any()) or bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"{name}: temperature must be >= 0 and top_p in (0, 1]")
    for gen in generators:
        if gen is not None and gen.device.type != logits.device.type:
            raise ValueError(f"{name}: generator on {gen.device}, logits on {logits.device}")


def top_k_top_p_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token per row of logits [B, V] -> int64 [B].

    temperature [B] (0 means greedy for that row), top_k [B] (<= 0 or >= V disables it), top_p [B]
    in (0, 1] (1 disables it). Rows keep the top_k largest logits, then the smallest set of those
    whose probability reaches top_p (ties with the cut-off are kept), and draw by the
    exponential-race method: argmax(p / E) with E ~ Exp(1), which samples exactly from p.
    A row with a generator draws its E from it alone, so its token depends only on its own logits,
    parameters and generator state; rows without one share the default generator.
    """
    _check_sampling_args(logits, temperature, top_k, top_p, generators)
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits.float() / temp[:, None]
    scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)

    noise = torch.empty_like(probs)
    shared_rows = [i for i, gen in enumerate(generators) if gen is None]
    if shared_rows:
        rows = torch.tensor(shared_rows, device=logits.device)
        noise[rows] = torch.empty((len(shared_rows), vocab), device=logits.device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    sampled = torch.argmax(probs / noise, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and then its top-p nucleus."""
    vocab = logits.shape[1]
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a sorted entry while the mass before it is below top_p (so the first is always kept).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = mass_before < top_p[:, None].float()
    keep[:, 0] = True
    num_keep = keep.sum(dim=-1, keepdim=True)
    threshold = sorted_logits.gather(1, num_keep - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Per-row probabilities [B, V] that :func:`top_k_top_p_sample` draws from (for tests):
    a one-hot at the argmax for greedy rows, else the renormalised top-k/top-p distribution,
    computed one row at a time with Python sorting, independently of the batched path."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for i in range(logits.shape[0]):
        row = logits[i].double()
        temp = float(temperature[i])
        if temp == 0:
            out[i, int(torch.argmax(logits[i]))] = 1.0
            continue
        probs = torch.softmax(row / temp, dim=-1)
        order = sorted(range(row.numel()), key=lambda j: -float(row[j]))
        k = int(top_k[i])
        if 0 < k < row.numel():
            cutoff = float(row[order[k - 1]])
            order = [j for j in order if float(row[j]) >= cutoff]
        kept_total = sum(float(probs[j]) for j in order)
        chosen: list[int] = []
        mass = 0.0
        for j in order:
            if chosen and mass >= float(top_p[i]) * kept_total:
                if float(row[j]) < float(row[chosen[-1]]):
                    break
            chosen.append(j)
            mass += float(probs[j])
        for j in chosen:
            out[i, j] = float(probs[j])
        out[i] /= out[i].sum()
    return out
