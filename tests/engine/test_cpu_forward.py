"""The fused CPU forward (engine/cpu_forward.py) against the eager model on the same step: hidden
states and the KV it writes, for decode, prefill chunks and mixed batches, on every family's
variant (GQA, Qwen2's QKV bias, Qwen3's q/k norm, Mistral's sliding window); plus when it is on,
and its refusal of bad input. Token parity with Hugging Face is tests/engine/test_engine_parity.py,
which runs with the fused forward on (the default)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from checkpoints import write_random_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine.cpu_forward import CpuForward
from tandem.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU kernels could not be built")

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-mqa": ("qwen2", {"num_kv_heads": 1, "tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, kwargs = VARIANTS[request.param]
    return write_random_checkpoint(tmp_path_factory.mktemp(request.param), arch, **kwargs)


def _both_ways(llm: LLM) -> None:
    """Schedule one step, run it fused and eagerly from the same cache; both must agree."""
    engine = llm.engine
    runner = engine.runner
    out = engine.scheduler.schedule()
    inputs = runner.prepare(out)
    before = runner.kv_cache.clone()
    assert runner.cpu_forward is not None and runner.cpu_forward.accepts(inputs)
    fused = runner.cpu_forward.run(inputs).clone()
    fused_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    with torch.inference_mode():
        eager = runner.model(
            inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, runner.backend
        )
    torch.testing.assert_close(fused, eager, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fused_cache, runner.kv_cache, atol=2e-5, rtol=1e-4)
    engine.scheduler.update(out, runner.execute(out, inputs))


def test_fused_step_equals_eager_step(model_path: Path) -> None:
    """Step 1: three prompts in chunks of a 24-token budget (a mixed batch follows);
    later steps: decode only. Sequence lengths pass the window (8) and the block size (16)."""
    llm = LLM(str(model_path), num_blocks=32, max_num_batched_tokens=24)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, n in enumerate((5, 17, 40)):
        llm.engine.add_request(f"r{i}", [rng.randrange(300) for _ in range(n)], params)
    kinds = set()
    while llm.engine.has_unfinished and len(kinds) < 3:
        sched = llm.engine.scheduler
        pending = [r for r in sched.running + sched.waiting if r.num_computed_tokens < r.num_tokens]
        decode_only = all(r.num_tokens - r.num_computed_tokens == 1 for r in pending)
        prefill = all(r.num_computed_tokens == 0 for r in pending)
        kinds.add("decode" if decode_only else "prefill" if prefill else "mixed")
        _both_ways(llm)
    assert kinds == {"decode", "prefill", "mixed"}


def test_the_fused_forward_is_the_default_on_cpu_and_off_when_asked(llama_gqa_path: Path) -> None:
    assert isinstance(LLM(str(llama_gqa_path), num_blocks=32).engine.runner.cpu_forward, CpuForward)
    eager = LLM(str(llama_gqa_path), num_blocks=32, enforce_eager=True).engine.runner
    assert eager.cpu_forward is None and eager.backend.cpu_kernels  # eager, on the kernels
    plain = LLM(str(llama_gqa_path), num_blocks=32, cpu_kernels=False).engine.runner
    assert plain.cpu_forward is None and not plain.backend.cpu_kernels
    bf16 = LLM(str(llama_gqa_path), num_blocks=32, dtype="bfloat16").engine.runner
    assert bf16.cpu_forward is None  # float32 only; other dtypes run eagerly


def test_fused_and_eager_engines_give_the_same_tokens(llama_gqa_path: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 16, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = LLM(str(llama_gqa_path), num_blocks=64).generate(prompts, params)
    eager = LLM(str(llama_gqa_path), num_blocks=64, enforce_eager=True).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in eager]


def test_a_step_beyond_the_scratch_cap_runs_eagerly(llama_gqa_path: Path) -> None:
    llm = LLM(str(llama_gqa_path), num_blocks=32)
    fused = llm.engine.runner.cpu_forward
    fused.max_tokens = 8  # the cap that SCRATCH_BYTES sets for large models
    calls = []
    original = llm.engine.runner.model.forward
    llm.engine.runner.model.forward = lambda *a: calls.append(a[0].shape[0]) or original(*a)
    out = llm.generate([list(range(1, 21))], SamplingParams(temperature=0, max_tokens=3))
    assert calls == [20] and len(out[0].token_ids) == 3  # the prompt eager, decodes fused


def test_bad_step_input_is_refused_and_writes_nothing(llama_gqa_path: Path) -> None:
    llm = LLM(str(llama_gqa_path), num_blocks=32)
    runner = llm.engine.runner
    before = runner.kv_cache.clone()
    f = runner.cpu_forward.fused
    ids, pos, slots = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1])
    tables = torch.zeros((1, 2), dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    bad = [
        ((torch.tensor([1, 300]), pos, slots, tables, lens, qsl), "a token id"),
        ((ids, torch.tensor([0, 512]), slots, tables, lens, qsl), "a position"),
        ((ids, pos, torch.tensor([0, 32 * 16]), tables, lens, qsl), "a slot"),
        ((ids, pos, slots, torch.tensor([[0, 32]], dtype=torch.int32), lens.add(16), qsl),
         "metadata of sequence 0"),
        ((ids, pos, slots, tables, lens, None), "one token per sequence"),
        ((ids.int(), pos, slots, tables, lens, qsl), "int64 contiguous"),
    ]  # fmt: skip
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            f(*args)
    assert torch.equal(runner.kv_cache, before)
