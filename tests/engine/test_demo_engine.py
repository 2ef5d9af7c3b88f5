"""The demo model's task through Tandem's own engine: answers must be right, not just plausible."""

from __future__ import annotations

from tandem import LLM, SamplingParams
from tandem.engine.demo import expected_answer, held_out_inputs, make_user_message


def test_demo_task_accuracy_through_llm_generate() -> None:
    llm = LLM("demo")
    inputs = held_out_inputs(200)
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": make_user_message(s)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for s in inputs
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    correct = sum(o.text == expected_answer(s) for s, o in zip(inputs, outs, strict=True))
    assert correct / len(inputs) >= 0.95, f"{correct}/{len(inputs)}"
    assert all(
        o.finish_reason == "stop"
        for o, s in zip(outs, inputs, strict=True)
        if o.text == expected_answer(s)
    )
    llm.engine.check_integrity()


def test_unicode_round_trips_through_the_byte_level_tokenizer() -> None:
    llm = LLM("demo")
    text = "héllo 中文 👩‍👩‍👧 ok"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert llm.tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode())  # one token per byte: multi-byte chars span tokens
