"""Tiny random-weight Hugging Face checkpoints, written to disk so that our engine and
transformers load the very same weights in parity tests. A plain module (not conftest.py), so
every test directory can import it unambiguously."""

from __future__ import annotations

from pathlib import Path


def write_random_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 300,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Save a random-weight model of the given family plus the demo byte-level tokenizer.

    sliding_window: Mistral's window (None keeps the family's default)."""
    import torch
    import transformers

    from tandem.engine.demo.tokenizer_build import build_tokenizer

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if sliding_window is not None:
        common["sliding_window"] = sliding_window
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = cls[0](**common)
    model = cls[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # HF zero-inits biases; make Qwen2's QKV bias matter
    if max_shard_size is None:
        model.save_pretrained(path)
    else:  # several safetensors files plus model.safetensors.index.json
        model.save_pretrained(path, max_shard_size=max_shard_size)
    build_tokenizer().save_pretrained(path)
    return path
