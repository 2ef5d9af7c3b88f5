"""KV cache sizing on CUDA from a profile run, as vLLM does.

``build_engine_parts`` loads the weights, then calls ``profile_cuda``: one dummy forward of a
full step (``max_num_batched_tokens`` prompt tokens, split into sequences of at most
``max_model_len``, with the sampler on up to ``max_num_seqs`` rows) over a throw-away KV cache
just big enough for it, with the CUDA allocator's peak measured. ``kv_cache_bytes`` (pure) then
gives the KV cache what the memory limit leaves after that peak and after what the process holds
outside torch's allocator (CUDA context, cuBLAS workspaces):

    kv = total * gpu_memory_utilization - peak(weights + activations) - non_torch

``blocks_for`` turns bytes into blocks; ``summary`` is the line the worker logs (blocks, tokens,
and how many sequences of ``max_model_len`` fit at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.engine.attention import AttentionBackend
from tandem.engine.kv_layout import KVLayout
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    peak_bytes: int  # torch's allocator peak during the profile step (weights + activations)
    non_torch_bytes: int  # used on the device outside torch's allocator
    profile_kv_bytes: int  # the throw-away KV cache counted in the peak


def kv_cache_bytes(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """What the KV cache may take; ValueError when the model leaves nothing for it."""
    limit = int(profile.total_bytes * gpu_memory_utilization)
    used = profile.peak_bytes - profile.profile_kv_bytes + profile.non_torch_bytes
    budget = limit - used
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: weights and activations peak at "
            f"{used / 2**30:.2f} GiB of the {limit / 2**30:.2f} GiB that "
            f"gpu_memory_utilization={gpu_memory_utilization} allows; raise it or lower "
            "max_num_batched_tokens"
        )
    return budget


def blocks_for(budget_bytes: int, block_bytes: int) -> int:
    return max(0, budget_bytes // block_bytes)


def summary(num_blocks: int, block_size: int, max_model_len: int, source: str) -> str:
    tokens = num_blocks * block_size
    per_seq = math.ceil(max_model_len / block_size)
    return (
        f"KV cache: {num_blocks} blocks of {block_size} tokens ({tokens} tokens, {source}); "
        f"{num_blocks // per_seq} sequences of max_model_len={max_model_len} fit at once"
    )


def _dummy_step(
    layout: KVLayout, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
) -> SchedulerOutput:
    """Prompt chunks filling one step's token budget, each sampled (the sampler's peak too)."""
    out = SchedulerOutput()
    params = SamplingParams(temperature=1.0, max_tokens=1)
    remaining, next_block, i = max_num_batched_tokens, 0, 0
    while remaining > 0 and i < max_num_seqs:
        n = min(remaining, max_model_len - 1)
        req = Request(f"profile-{i}", [0] * n, params, eos_token_ids=frozenset(),
                      block_size=layout.block_size, max_tokens=1)  # fmt: skip
        blocks = math.ceil(n / layout.block_size)
        req.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        out.scheduled.append(ScheduledRequest(req, n, sample=True))
        out.num_batched_tokens += n
        remaining -= n
        i += 1
    return out


def profile_blocks_needed(
    block_size: int, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
) -> int:
    """Blocks of the throw-away KV cache the dummy step writes into."""
    layout = KVLayout(1, 1, 1, block_size, "float32", 1)
    step = _dummy_step(layout, max_num_batched_tokens, max_model_len, max_num_seqs)
    return sum(len(s.request.block_ids) for s in step.scheduled)


def profile_cuda(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    layout_one: KVLayout,
    device: torch.device,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
) -> MemoryProfile:
    """Run the dummy step on ``device`` and measure (weights already loaded there)."""
    blocks = profile_blocks_needed(
        layout_one.block_size, max_num_batched_tokens, max_model_len, max_num_seqs
    )
    layout = layout_one.with_num_blocks(blocks)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, backend, layout, device)
    runner.execute(_dummy_step(layout, max_num_batched_tokens, max_model_len, max_num_seqs))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    del runner
    torch.cuda.empty_cache()
    return MemoryProfile(total, peak, non_torch, layout.num_blocks * layout.block_bytes)
