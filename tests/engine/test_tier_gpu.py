"""The host KV tier on CUDA: pinned host memory, the copy stream, events and checksums on the
device. Skipped without a GPU (none on CI); run on a GPU machine with `scripts/test -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.kv_checksum import block_checksums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
PROMPTS = [[(7 * i + 13 * j) % 300 for j in range(30)] for i in range(6)]
GPU = {"device": "cuda", "max_model_len": 128}


def test_checksums_agree_between_cpu_and_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        blocks = torch.randn((3, 2, 2, 16, 2, 64), generator=g).to(dtype)
        assert torch.equal(block_checksums(blocks), block_checksums(blocks.cuda()).cpu())


def test_swaps_and_host_hits_on_cuda_keep_the_output(llama_gqa_path: Path) -> None:
    expected = LLM(str(llama_gqa_path), num_blocks=128, **GPU).generate(PROMPTS, LONG)
    llm = LLM(str(llama_gqa_path), num_blocks=16, kv_offload_bytes=1 << 20, **GPU)
    assert llm.engine.copier is not None and llm.engine.copier.host.is_pinned()
    outs = llm.generate(PROMPTS, LONG)
    again = llm.generate(PROMPTS, LONG)  # the second pass hits the host tier
    stats = llm.engine.stats()
    assert stats.num_swap_preemptions > 0
    assert stats.host_tier is not None and stats.host_tier.hit_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 16


def test_corrupted_pinned_host_bytes_are_recomputed_on_cuda(llama_gqa_path: Path) -> None:
    expected = LLM(str(llama_gqa_path), num_blocks=128, **GPU).generate(PROMPTS[0], LONG)
    llm = LLM(str(llama_gqa_path), num_blocks=8, kv_offload_bytes=1 << 20, **GPU)
    engine = llm.engine
    assert engine.kv.tier is not None and engine.copier is not None
    for p in PROMPTS[:4]:
        llm.generate(p, LONG)
    hashes = engine.make_requests("probe", PROMPTS[0], LONG)[0].block_hashes[:1]
    block = engine.kv.tier.host.lookup(hashes[0])
    assert block is not None
    engine.copier.host[block.block_id].view(-1)[3] += 1.0
    out = llm.generate(PROMPTS[0], LONG)[0]
    assert out.token_ids == expected[0].token_ids and out.num_cached_tokens == 0
    assert dict(engine.stats().host_tier.integrity_failures)["checksum_mismatch"] == 1  # type: ignore[union-attr]
    engine.check_integrity()
