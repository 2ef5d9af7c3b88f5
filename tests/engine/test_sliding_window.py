"""Mistral's sliding-window attention: token-for-token parity with transformers beyond the window
(window 32, sequences past 100), in both backends and with every CPU path, with chunked prefill,
prefix-cache hits, and the per-layer windows read from the config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import write_random_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine.models.llama import ModelArchConfig

WINDOW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("mistral_sw"), "mistral", sliding_window=WINDOW
    )


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int, **overrides) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **overrides
    ).eval()
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


def prompts_of(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


LENGTHS = (5, 31, 32, 33, 100, 130)


@pytest.fixture(scope="module")
def expected(mistral_path: Path) -> list[list[int]]:
    return hf_greedy(mistral_path, prompts_of(1, LENGTHS), GREEDY.max_tokens)


def test_the_window_changes_hf_output(mistral_path: Path, expected: list[list[int]]) -> None:
    """Guard: beyond the window, full attention would give other tokens (the tests can fail)."""
    full = hf_greedy(mistral_path, prompts_of(1, LENGTHS), GREEDY.max_tokens, sliding_window=None)
    assert full[:2] == expected[:2]  # shorter than the window throughout
    assert full[4:] != expected[4:]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch-path"])
def test_torch_backend_matches_hf_beyond_the_window(
    mistral_path: Path, expected: list[list[int]], cpu_kernels: bool
) -> None:
    llm = LLM(str(mistral_path), num_blocks=96, cpu_kernels=cpu_kernels)
    assert llm.engine.runner.backend.cpu_kernels is cpu_kernels
    assert llm.engine.arch.sliding_windows == (WINDOW,) * llm.engine.arch.num_layers
    outs = llm.generate(prompts_of(1, LENGTHS), GREEDY)
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 96


def test_chunked_prefill_and_prefix_hits_keep_the_window(mistral_path: Path) -> None:
    """Chunks of 8 tokens cross the window's edge at every step; the second wave's prompts share
    a 64-token prefix whose blocks (mostly outside the window) come from the prefix cache."""
    rng = random.Random(4)
    prefix = [rng.randrange(300) for _ in range(64)]
    prompts = [prefix + [rng.randrange(300) for _ in range(k)] for k in (40, 50)]
    want = hf_greedy(mistral_path, prompts, GREEDY.max_tokens)
    llm = LLM(str(mistral_path), num_blocks=64, max_num_batched_tokens=8)
    assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] == want[:1]
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 64
    assert [o.token_ids for o in second] == want[1:]
    llm.engine.check_integrity()


def test_triton_backend_matches_hf_beyond_the_window(
    mistral_path: Path, expected: list[list[int]]
) -> None:
    """Under the interpreter here (slow: the two longest prompts and 4 tokens only)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(mistral_path), num_blocks=32, attention_backend="triton")
    outs = llm.generate(prompts_of(1, LENGTHS)[4:], params)
    assert [o.token_ids for o in outs] == [e[:4] for e in expected[4:]]


def _cfg(**extra) -> dict:
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "max_position_embeddings": 1024,
    }
    return base | extra


def test_windows_per_layer_are_read_as_transformers_reads_them() -> None:
    windows = lambda **kw: ModelArchConfig.from_hf(_cfg(**kw)).sliding_windows  # noqa: E731
    assert windows(sliding_window=32) == (32, 32, 32, 32)
    assert windows(sliding_window=None) == ()
    assert windows(sliding_window=4096) == ()  # longer than any sequence can be
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "max_window_layers": 2}
    assert windows(**qwen) == ()  # use_sliding_window defaults to false
    assert windows(**qwen, use_sliding_window=True) == (0, 0, 32, 32)
    types = ["full_attention", "sliding_attention"] * 2
    assert windows(sliding_window=32, layer_types=types) == (0, 32, 0, 32)
    assert windows(architectures=["LlamaForCausalLM"], sliding_window=32) == ()
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        windows(sliding_window=-1)
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        windows(sliding_window=32, layer_types=types[:2])
    with pytest.raises(ValueError, match="unsupported layer_types"):
        windows(sliding_window=32, layer_types=["chunked_attention"] * 4)
