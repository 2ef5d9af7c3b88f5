"""KV cache sizing arithmetic (CUDA's profile run is in test_engine_gpu.py): what the budget is,
how many blocks and sequences fit, and that the dummy step is a valid step of the runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.attention import get_backend
from tandem.engine.kv_layout import KVLayout
from tandem.engine.memory_profile import (
    MemoryProfile,
    _dummy_step,
    blocks_for,
    kv_cache_bytes,
    profile_blocks_needed,
    summary,
)

GiB = 2**30


def test_budget_is_the_limit_minus_the_peak_and_non_torch_memory() -> None:
    p = MemoryProfile(total_bytes=80 * GiB, peak_bytes=20 * GiB, non_torch_bytes=1 * GiB,
                      profile_kv_bytes=2 * GiB)  # fmt: skip
    # 0.9 x 80 = 72 GiB allowed; the peak without the throw-away cache is 18, plus 1 outside.
    assert kv_cache_bytes(p, 0.9) == int(80 * GiB * 0.9) - 18 * GiB - 1 * GiB
    assert kv_cache_bytes(p, 0.5) == 40 * GiB - 19 * GiB
    with pytest.raises(ValueError, match="no GPU memory left"):
        kv_cache_bytes(p, 0.2)  # 16 GiB allowed < 19 used


def test_blocks_and_summary() -> None:
    assert blocks_for(10 * 1024, 4096) == 2 and blocks_for(100, 4096) == 0
    line = summary(num_blocks=1000, block_size=16, max_model_len=4096, source="profiled")
    # 1000 blocks = 16000 tokens; one 4096-token sequence needs 256 blocks: 3 fit
    assert line == ("KV cache: 1000 blocks of 16 tokens (16000 tokens, profiled); 3 sequences of "
                    "max_model_len=4096 fit at once")  # fmt: skip


def test_dummy_step_fills_the_token_budget_within_the_context() -> None:
    layout = KVLayout(1, 1, 8, 16, "float32", 1)
    step = _dummy_step(layout, max_num_batched_tokens=1000, max_model_len=300, max_num_seqs=8)
    lens = [s.num_new_tokens for s in step.scheduled]
    assert lens == [299, 299, 299, 103] and step.num_batched_tokens == 1000
    assert all(s.sample for s in step.scheduled)
    blocks = [b for s in step.scheduled for b in s.request.block_ids]
    assert blocks == list(range(len(blocks)))  # distinct, packed from 0
    assert profile_blocks_needed(16, 1000, 300, 8) == len(blocks) == 19 + 19 + 19 + 7
    capped = _dummy_step(layout, 1000, 300, max_num_seqs=2)
    assert [s.num_new_tokens for s in capped.scheduled] == [299, 299]


def test_dummy_step_runs_through_the_model_runner(llama_gqa_path: Path) -> None:
    from tandem import LLM
    from tandem.engine.model_runner import ModelRunner

    engine = LLM(str(llama_gqa_path), num_blocks=64).engine
    one = engine.layout.with_num_blocks(1)
    blocks = profile_blocks_needed(one.block_size, 200, engine.max_model_len, 4)
    layout = one.with_num_blocks(blocks)
    runner = ModelRunner(engine.runner.model, get_backend("torch"), layout, torch.device("cpu"))
    result = runner.execute(_dummy_step(layout, 200, engine.max_model_len, 4))
    assert len(result.sampled_token_ids) == len(
        _dummy_step(layout, 200, engine.max_model_len, 4).scheduled
    )
