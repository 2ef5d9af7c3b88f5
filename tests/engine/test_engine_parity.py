"""Greedy token-for-token parity with Hugging Face transformers, under every scheduling regime."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import write_random_checkpoint

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Mixed lengths around the block size (16): exact multiples and +-1.
LENGTHS = (1, 7, 15, 16, 17, 31, 32, 33, 48, 70)


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        g = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(g[0, len(p) :].tolist())
    return outs


def random_prompts(seed: int, vocab: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("fixture", ["llama_gqa_path", "qwen2_path"])
def test_random_weight_models_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    prompts = random_prompts(1, 300)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(str(path), num_blocks=128)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 128


def test_tiny_token_budget_forces_chunked_prefill(llama_gqa_path: Path) -> None:
    prompts = random_prompts(2, 300, (40, 70, 5))
    expected = hf_greedy(llama_gqa_path, prompts, GREEDY.max_tokens)
    llm = LLM(str(llama_gqa_path), num_blocks=64, max_num_batched_tokens=8)
    steps = []
    engine = llm.engine
    original = engine.scheduler.schedule

    def spy():
        out = original()
        steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(sum(n for _, n in step) <= 8 for step in steps)
    # The 70-token prompt needed at least 9 prefill chunks.
    assert sum(1 for step in steps for rid, n in step if rid == outs[1].request_id and n > 1) >= 8
    engine.check_integrity()


def test_shared_prefix_hits_the_cache_and_still_matches(llama_gqa_path: Path) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(300) for _ in range(48)]
    prompts = [prefix + [rng.randrange(300) for _ in range(k)] for k in (1, 5, 16, 20)]
    expected = hf_greedy(llama_gqa_path, prompts, GREEDY.max_tokens)
    llm = LLM(str(llama_gqa_path), num_blocks=128)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    assert [o.num_cached_tokens for o in rest] == [48, 48, 64 - 16]
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens == 48 * 3
    llm.engine.check_integrity()


def test_preemption_by_recompute_keeps_greedy_output(llama_gqa_path: Path) -> None:
    prompts = random_prompts(4, 300, (30, 30, 30, 30, 30, 30))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(llama_gqa_path, prompts, 40)
    # 6 sequences of up to 70 tokens need 30 blocks; 16 force preemption.
    llm = LLM(str(llama_gqa_path), num_blocks=16, max_model_len=256, enable_prefix_caching=False)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 16


def test_demo_model_matches_hf() -> None:
    from tandem.engine.demo import raw_prompt, sample_inputs, weights_path

    path = weights_path()
    llm = LLM("demo")
    prompts = [
        llm.tokenizer.encode(raw_prompt(s), add_special_tokens=False) for s in sample_inputs(6, 11)
    ]
    prompts += random_prompts(5, 256, (16, 33))
    expected = hf_greedy(path, prompts, 12)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("mistral", {}),
        ("qwen3", {}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "max_shard_size": "100KB",
            },
        ),
    ],
    ids=["mistral", "qwen3-qk-norm", "llama-rope-linear", "llama-rope-llama3-sharded"],
)
def test_other_families_and_rope_scaling_match_hf(arch: str, kwargs: dict, tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, arch, **kwargs)
    if "max_shard_size" in kwargs:
        assert (path / "model.safetensors.index.json").is_file()
    prompts = random_prompts(8, 300, (5, 17, 70, 130))
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    outs = LLM(str(path), num_blocks=96).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        LLM(str(tmp_path))
