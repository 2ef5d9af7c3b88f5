"""A random-weight Llama with the demo's byte-level tokenizer and chat template.

Big enough that prefill, not per-token serving overhead, dominates a worker's time on a CPU. Its
output head is zero outside printable ASCII, so greedy replies are ASCII text that tokenizes back
to exactly the generated ids (one token per byte).
"""

from __future__ import annotations

from pathlib import Path

FIRST_PRINTABLE, LAST_PRINTABLE = 0x20, 0x7E


def write_chat_llama(
    out: Path, hidden: int = 256, layers: int = 4, seed: int = 0, context: int = 2048
) -> Path:
    """A random-weight Llama (GQA with 2 KV heads of dim 64 when hidden >= 256, vocab 4096,
    ``context`` positions) with the demo tokenizer. The output head is zero outside printable
    ASCII: those logits are 0 while the max over 95 random printable rows is positive, so greedy
    picks printable ASCII."""
    import torch
    import transformers

    from tandem.engine.demo.tokenizer_build import build_tokenizer

    if hidden % 64 or layers < 1:
        raise ValueError(f"hidden must be a multiple of 64 and layers >= 1, got {hidden}, {layers}")
    torch.manual_seed(seed)
    heads = hidden // 32 if hidden <= 256 else hidden // 64
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=context,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        keep = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        keep[FIRST_PRINTABLE : LAST_PRINTABLE + 1] = True
        model.lm_head.weight[~keep] = 0.0
    model.save_pretrained(out)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = cfg.max_position_embeddings  # the demo's 256 does not apply
    tokenizer.save_pretrained(out)
    return out
