"""The whole engine with the Triton attention backend (CPU interpreter here, CUDA on a GPU)
produces the torch backend's greedy tokens on the demo model."""

from __future__ import annotations

from tandem import LLM, SamplingParams
from tandem.engine.demo import raw_prompt


def test_triton_backend_matches_torch_backend_on_the_demo_model() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    torch_llm = LLM("demo", num_blocks=32, attention_backend="torch")
    prompts = [raw_prompt(s) for s in ("a", "tandem", "abc123xyz9")]
    ids = [torch_llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    # A shared 16-token prefix so the second wave hits the cache (extend over cached blocks).
    ids.append(ids[2][:16] + ids[1][:3])
    expected = torch_llm.generate(ids, params)
    # Budget 8: prefill runs in chunks, mixed with decodes (extend kernel), then decode kernel.
    triton_llm = LLM("demo", num_blocks=32, attention_backend="triton", max_num_batched_tokens=8)
    assert triton_llm.engine.runner.backend.name == "triton"
    got = triton_llm.generate(ids, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    triton_llm.engine.check_integrity()
