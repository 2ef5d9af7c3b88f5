"""The engine on CUDA: Triton backend and CUDA graphs against the CPU torch path. Skipped without a
GPU (none on CI); run on a GPU machine with `scripts/test -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 33, 70)]


def test_cuda_graphs_and_eager_match_the_cpu_engine(llama_gqa_path: Path) -> None:
    cpu = LLM(str(llama_gqa_path), num_blocks=128).generate(prompts(), GREEDY)
    for eager in (True, False):
        gpu = LLM(str(llama_gqa_path), num_blocks=128, device="cuda", enforce_eager=eager)
        assert gpu.engine.runner.backend.name == "triton"
        assert (gpu.engine.runner.graphs is None) == eager
        outs = gpu.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in cpu]
        gpu.engine.check_integrity()


def test_bf16_engine_runs_and_mostly_agrees(llama_gqa_path: Path) -> None:
    cpu = LLM(str(llama_gqa_path), num_blocks=128).generate(prompts(), GREEDY)
    gpu = LLM(str(llama_gqa_path), num_blocks=128, device="cuda", dtype="bfloat16")
    outs = gpu.generate(prompts(), GREEDY)
    # bf16 rounding may flip a late near-tie; the first tokens must agree.
    assert [o.token_ids[:2] for o in outs] == [o.token_ids[:2] for o in cpu]


def test_kv_cache_is_sized_from_a_profile_run(llama_gqa_path: Path, caplog) -> None:
    """On CUDA the KV cache gets what gpu_memory_utilization leaves after the measured peak of
    a full dummy step, and the worker says how many blocks and full-length sequences fit."""
    import logging

    from tandem.engine.memory_profile import kv_cache_bytes, profile_cuda

    caplog.set_level(logging.INFO, logger="tandem.engine.builder")
    torch.cuda.empty_cache()
    llm = LLM(str(llama_gqa_path), device="cuda", gpu_memory_utilization=0.5,
              max_num_batched_tokens=512, enforce_eager=True)  # fmt: skip
    engine = llm.engine
    layout = engine.layout
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert f"{layout.num_blocks} blocks" in line and "profiled" in line
    assert "sequences of max_model_len" in line
    # Re-profile with the engine's KV cache in place: the budget the builder used, minus what
    # that cache now takes, must be ~0 (the cache filled exactly the measured headroom).
    one = layout.with_num_blocks(1)
    profile = profile_cuda(engine.runner.model, engine.runner.backend, one, torch.device("cuda"),
                           512, engine.max_model_len, 256)  # fmt: skip
    used = profile.peak_bytes - profile.profile_kv_bytes + profile.non_torch_bytes
    limit = 0.5 * profile.total_bytes
    assert abs(limit - used) < 0.05 * profile.total_bytes, (used / 2**30, limit / 2**30)
    with pytest.raises(ValueError, match="no GPU memory left"):
        kv_cache_bytes(profile, 0.25)  # the cache already holds the rest
    assert layout.num_blocks * layout.block_bytes <= limit
    out = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out[0].token_ids) == 12
