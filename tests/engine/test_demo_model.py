"""Tests of the bundled demo model: task helpers, byte-level tokenizer, chat template, weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

import tandem.engine.demo as demo
from tandem.engine.demo import task
from tandem.engine.demo.tokenizer_build import VOCAB_SIZE, build_tokenizer
from tandem.engine.demo.train import (
    IGNORE_INDEX,
    TrainConfig,
    collate,
    encode_example,
    greedy_answers,
    lr_at,
    train,
    training_inputs,
)

ROUND_TRIP_TEXTS = [
    "hello, world! 123",
    "😀🚀👍🏽",
    "日本語のテキスト，中文",
    "mixed: café ñ ü 😀 日本 \t\n end",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(demo.weights_path())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(demo.weights_path(), dtype=torch.float32)
    m.eval()
    return m


# --- task ---------------------------------------------------------------------------------------


def test_task_helpers_exact() -> None:
    assert task.make_user_message("abc") == "reverse: abc"
    assert task.expected_answer("abc1") == "1cba"
    assert task.raw_prompt("ab") == "<|bos|><|user|>reverse: ab<|assistant|>"


@pytest.mark.parametrize("bad", ["", "a" * (task.MAX_LEN + 1), "ABC", "a b", "é"])
def test_task_rejects_bad_input(bad: str) -> None:
    with pytest.raises(ValueError):
        task.expected_answer(bad)
    with pytest.raises(ValueError):
        task.make_user_message(bad)


def test_sample_inputs_deterministic_and_valid() -> None:
    first = task.sample_inputs(50, seed=7)
    assert first == task.sample_inputs(50, seed=7)
    assert first != task.sample_inputs(50, seed=8)
    for s in first:
        task.validate_input(s)
    lengths = {len(s) for s in task.sample_inputs(500, seed=7)}
    assert lengths == set(range(task.MIN_LEN, task.MAX_LEN + 1))
    assert all(len(s) == task.MAX_LEN for s in task.sample_inputs(20, 3, min_len=task.MAX_LEN))


def test_training_data_deterministic_and_excludes_held_out() -> None:
    a, b = training_inputs(seed=5, batch_size=64), training_inputs(seed=5, batch_size=64)
    batches_a = [next(a) for _ in range(20)]
    assert batches_a == [next(b) for _ in range(20)]
    assert batches_a[0] != next(training_inputs(seed=6, batch_size=64))
    held_out = {s for s in task.held_out_inputs() if len(s) >= task.HELD_OUT_MIN_LEN}
    assert len(held_out) > 150
    assert not held_out & {s for batch in batches_a for s in batch}


def test_encode_example_masks_prompt() -> None:
    tok = build_tokenizer()
    ids, labels = encode_example(tok, "ab")
    prompt_len = len(tok.encode(task.raw_prompt("ab")))
    assert ids == tok.encode(task.raw_prompt("ab")) + [ord("b"), ord("a"), tok.eos_token_id]
    assert labels == [IGNORE_INDEX] * prompt_len + [ord("b"), ord("a"), tok.eos_token_id]
    batch = collate([encode_example(tok, "ab"), encode_example(tok, "abcd")], tok.pad_token_id)
    # "abcd" has 2 more prompt tokens and 2 more answer tokens than "ab", so row 0 gets 4 pads.
    assert batch.input_ids.shape == (2, prompt_len + 3 + 4)
    assert batch.input_ids[0].tolist() == ids + [tok.pad_token_id] * 4
    assert batch.labels[0].tolist() == labels + [IGNORE_INDEX] * 4


def test_lr_schedule() -> None:
    cfg = TrainConfig(max_steps=1000, warmup_steps=100, decay_steps=200, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg, None) == pytest.approx(1e-5)
    assert lr_at(99, cfg, None) == pytest.approx(1e-3)
    assert lr_at(700, cfg, None) == pytest.approx(1e-3)
    assert lr_at(499, cfg, 500) == pytest.approx(1e-3)
    assert lr_at(599, cfg, 500) == pytest.approx(1e-3 * (1 - 0.9 * 0.5))
    assert lr_at(699, cfg, 500) == pytest.approx(1e-4)


def test_training_is_reproducible_from_seed() -> None:
    tok = build_tokenizer()

    def run(seed: int) -> dict[str, torch.Tensor]:
        cfg = TrainConfig(
            seed=seed, max_steps=3, warmup_steps=1, decay_steps=2, batch_size=4, eval_every=1000
        )
        return train(cfg, tok).state_dict()

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_train_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=250, warmup_steps=100, decay_steps=200)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)


# --- tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trip_bytes(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_multibyte_character_is_several_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("😀")
    assert ids == [0xF0, 0x9F, 0x98, 0x80]
    assert tokenizer.decode(ids[:2]) != "😀"
    assert tokenizer.decode(ids) == "😀"


def test_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.bos_token_id == 256
    assert tokenizer.eos_token == "<|end|>" and tokenizer.eos_token_id == 257
    assert tokenizer.pad_token_id == 258
    prompt_ids = tokenizer.encode(task.raw_prompt("a1"))
    assert prompt_ids == [256, 260, *b"reverse: a1", 261]
    assert tokenizer.decode(prompt_ids, skip_special_tokens=True) == "reverse: a1"


def test_saved_tokenizer_matches_builder(tokenizer: PreTrainedTokenizerBase) -> None:
    built = build_tokenizer()
    for text in [*ROUND_TRIP_TEXTS, task.raw_prompt("xyz")]:
        assert built.encode(text) == tokenizer.encode(text)


def test_chat_template_matches_raw_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": task.make_user_message("hello9")}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == task.raw_prompt("hello9")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tokenizer.encode(task.raw_prompt("hello9"))
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "<|bos|><|user|>reverse: hello9"


def test_chat_template_multi_turn_and_system(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "reverse: cd"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>be brief<|user|>reverse: ab<|assistant|>ba<|end|>"
        "<|user|>reverse: cd<|assistant|>"
    )


def test_chat_template_rejects_unknown_role(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="unknown role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# --- weights ------------------------------------------------------------------------------------


def test_weights_dir_is_standard_and_small() -> None:
    path = demo.weights_path()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert sum(p.stat().st_size for p in path.iterdir() if p.is_file()) <= 20 * 1024 * 1024


def test_weights_path_missing_is_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo, "_WEIGHTS_DIR", tmp_path)
    with pytest.raises(demo.DemoWeightsMissingError, match="config.json.*tandem.engine.demo.train"):
        demo.weights_path()


def test_model_config(model: torch.nn.Module) -> None:
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == VOCAB_SIZE
    assert cfg.eos_token_id == 257


def _check_answers(model, tokenizer, inputs: list[str], min_accuracy: float) -> None:
    answers = greedy_answers(model, tokenizer, inputs)
    wrong = [(s, a) for s, a in zip(inputs, answers, strict=True) if a != task.expected_answer(s)]
    accuracy = 1 - len(wrong) / len(inputs)
    assert accuracy >= min_accuracy, f"accuracy {accuracy:.3f}; wrong (input, answer): {wrong[:10]}"


def test_greedy_accuracy_held_out(model, tokenizer: PreTrainedTokenizerBase) -> None:
    # greedy_answers marks a missing EOS, so a right answer without EOS after it counts as wrong.
    _check_answers(model, tokenizer, task.held_out_inputs(100), min_accuracy=0.95)


def test_greedy_accuracy_at_max_length(model, tokenizer: PreTrainedTokenizerBase) -> None:
    inputs = task.sample_inputs(50, seed=99, min_len=task.MAX_LEN)
    _check_answers(model, tokenizer, inputs, min_accuracy=0.95)


def test_eos_right_after_answer(model, tokenizer: PreTrainedTokenizerBase) -> None:
    inputs = ["a", "9z", "abcdefghij"[: task.MAX_LEN]]
    enc = tokenizer([task.raw_prompt(s) for s in inputs], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=task.MAX_LEN + 2)
    for s, row in zip(inputs, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
        answer = list(task.expected_answer(s).encode())
        assert row[: len(answer) + 1] == answer + [tokenizer.eos_token_id]
