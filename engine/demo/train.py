"""Trains the bundled demo model: a tiny Llama (GQA) that reverses short strings.

Run `python -m tandem.engine.demo.train [--out DIR] [--seed S] [--steps N]`. It writes a standard
Hugging Face directory (config.json, generation_config.json, model.safetensors, tokenizer files)
that the engine's loader and `transformers.AutoModelForCausalLM` both read. Training data is
generated from the task on the fly, seeded, so a run is reproducible on the same software and
thread count. Fresh random strings every step mean the model cannot overfit; the held-out inputs
(task.held_out_inputs) are excluded from training and used for the final accuracy report.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from tandem.engine.demo import task
from tandem.engine.demo.tokenizer_build import VOCAB_SIZE, build_tokenizer

IGNORE_INDEX = -100
DEFAULT_OUT = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyperparameters of one training run (defaults produce the bundled weights).

    The schedule is warmup, then a constant learning rate until the model answers at least
    `target_accuracy` of the validation inputs (checked every `eval_every` steps), then a linear
    decay over `decay_steps`. The stopping point depends only on the seed, not on machine speed.
    If the target is never met, decay starts at `max_steps - decay_steps`.
    """

    seed: int = 0
    max_steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.02
    warmup_steps: int = 50
    decay_steps: int = 200
    eval_every: int = 100
    target_accuracy: float = 0.99
    num_val: int = 200
    val_seed: int = 4321
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    threads: int = 1
    log_every: int = 50

    def __post_init__(self) -> None:
        if self.max_steps < self.warmup_steps + self.decay_steps:
            raise ValueError("max_steps must be >= warmup_steps + decay_steps")
        if min(self.batch_size, self.eval_every, self.num_val, self.threads, self.log_every) < 1:
            raise ValueError("batch_size, eval_every, num_val, threads and log_every must be >= 1")


@dataclass(frozen=True, slots=True)
class Batch:
    """Right-padded training batch; labels are IGNORE_INDEX outside the answer and its EOS."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def model_config(tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The demo architecture: 4 layers, hidden 128, 4 query heads of dim 32 sharing 2 KV heads."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def encode_example(tokenizer: PreTrainedTokenizerBase, s: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer + EOS, and labels that score only the answer and the EOS."""
    prompt = tokenizer.encode(task.raw_prompt(s), add_special_tokens=False)
    answer = tokenizer.encode(task.expected_answer(s), add_special_tokens=False)
    answer.append(tokenizer.eos_token_id)
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-pads examples; with causal attention the padding never affects real tokens."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
    return Batch(input_ids=input_ids, labels=labels)


def training_inputs(seed: int, batch_size: int) -> Iterator[list[str]]:
    """Endless batches of task inputs for `seed`, never containing a held-out input."""
    excluded = {s for s in task.held_out_inputs() if len(s) >= task.HELD_OUT_MIN_LEN}
    rng = random.Random(seed)
    while True:
        batch: list[str] = []
        while len(batch) < batch_size:
            s = task.random_input(rng)
            if s not in excluded:
                batch.append(s)
        yield batch


def lr_at(step: int, cfg: TrainConfig, decay_start: int | None) -> float:
    """Linear warmup to cfg.lr, constant until decay_start (None: not yet), then linear decay to
    cfg.lr * cfg.min_lr_ratio over cfg.decay_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if decay_start is None or step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / cfg.decay_steps)
    return cfg.lr * (1.0 - (1.0 - cfg.min_lr_ratio) * progress)


def train(
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    on_best: Callable[[LlamaForCausalLM, int, float], None] | None = None,
) -> LlamaForCausalLM:
    """Trains a fresh model from cfg.seed and returns it in eval mode (caller owns it).

    `on_best(model, step, val_accuracy)` is called after each validation that beats the previous
    best, so a caller can keep a usable checkpoint if the run is interrupted.
    """
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(model_config(tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    batches = training_inputs(cfg.seed, cfg.batch_size)
    val_inputs = task.sample_inputs(cfg.num_val, cfg.val_seed)
    decay_start: int | None = None
    best_accuracy = -1.0
    start = time.monotonic()
    running = 0.0
    step = 0
    while decay_start is None or step < decay_start + cfg.decay_steps:
        if decay_start is None and step == cfg.max_steps - cfg.decay_steps:
            decay_start = step
        lr = lr_at(step, cfg, decay_start)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate(
            [encode_example(tokenizer, s) for s in next(batches)], tokenizer.pad_token_id
        )
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        running += loss.item()
        step += 1
        if step % cfg.log_every == 0:
            elapsed = time.monotonic() - start
            print(
                f"step {step} loss {running / cfg.log_every:.4f} lr {lr:.2e} {elapsed:.0f}s",
                flush=True,
            )
            running = 0.0
        if decay_start is None and step % cfg.eval_every == 0:
            model.eval()
            val_accuracy = accuracy(model, tokenizer, val_inputs)
            model.train()
            print(f"step {step} validation accuracy {val_accuracy:.3f}", flush=True)
            if on_best is not None and val_accuracy > best_accuracy:
                on_best(model, step, val_accuracy)
            best_accuracy = max(best_accuracy, val_accuracy)
            if val_accuracy >= cfg.target_accuracy:
                decay_start = step
    model.eval()
    return model


@torch.no_grad()
def greedy_answers(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    inputs: Sequence[str],
    batch_size: int = 100,
) -> list[str]:
    """Greedy completions of raw_prompt(s), decoded up to (not including) the EOS token."""
    answers: list[str] = []
    for i in range(0, len(inputs), batch_size):
        chunk = [task.raw_prompt(s) for s in inputs[i : i + batch_size]]
        enc = tokenizer(
            chunk,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=task.MAX_LEN + 2,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            answers.append(tokenizer.decode(_until_eos(row, tokenizer.eos_token_id)))
    return answers


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    """Ids before the first EOS; without one, all ids plus the EOS itself, which decodes to the
    EOS text so that a right answer missing its EOS never compares equal to the expected one."""
    if eos_id in ids:
        return ids[: ids.index(eos_id)]
    return ids + [eos_id]


def accuracy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, inputs: Sequence[str]
) -> float:
    """Fraction of inputs whose greedy answer is exactly the reversed string followed by EOS."""
    answers = greedy_answers(model, tokenizer, inputs)
    correct = sum(a == task.expected_answer(s) for s, a in zip(inputs, answers, strict=True))
    return correct / len(inputs)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Writes model, generation config and tokenizer as a standard HF directory."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    _add_legacy_config_keys(out)
    for path in out.iterdir():
        # safetensors writes 0600; the weights ship in the package and images run as non-root.
        if path.is_file():
            path.chmod(0o644)


def _add_legacy_config_keys(out: Path) -> None:
    """Adds the pre-5.0 spellings (top-level rope_theta, torch_dtype) that transformers 4.x and
    hand-written loaders read; transformers 5 reads rope_parameters and dtype, and accepts both."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if "rope_theta" not in config:
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    if "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _portable_tokenizer_config(out: Path) -> None:
    """Rewrites tokenizer_config.json in the spelling both transformers 4.x and 5.x read: the chat
    template inline, the PreTrainedTokenizerFast class, additional_special_tokens as a list."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        config["chat_template"] = jinja.read_text()
        jinja.unlink()
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in config:
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--steps",
        "--max-steps",
        dest="max_steps",
        type=int,
        default=defaults.max_steps,
        help="cap on training steps (training usually stops earlier, see TrainConfig)",
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(
            seed=args.seed,
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            threads=args.threads,
        )
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(cfg.threads)
    tokenizer = build_tokenizer()
    start = time.monotonic()
    # Saved tokenizers are built fresh: calling one with padding=True leaves padding state behind.
    model = train(
        cfg, tokenizer, on_best=lambda m, _step, _acc: save(m, build_tokenizer(), args.out)
    )
    train_seconds = time.monotonic() - start
    held_out = task.held_out_inputs()
    acc = accuracy(model, tokenizer, held_out)
    save(model, build_tokenizer(), args.out)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(
        f"trained in {train_seconds:.0f}s; params {params}; "
        f"size {size / 1e6:.2f} MB; held-out greedy accuracy {acc:.3f} on {len(held_out)} inputs"
    )


if __name__ == "__main__":
    main()
