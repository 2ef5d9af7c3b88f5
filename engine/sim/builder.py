"""``build_simulated_parts``: EngineParts for a simulated worker, from a profile, with no weights.

The model directory still provides config.json (the architecture, checked against the
profile's) and, for string prompts given offline, tokenizer.json, read with the `tokenizers`
library (workers receive token ids; importing transformers would cost each simulated worker ~80 MB
and seconds of start-up); the safetensors are never opened. EOS ids come from the profile. The
KV cache has the profile's layout and capacity (``num_blocks`` as measured, unless the engine
options set it) but no memory; the scheduler, block pool and prefix cache are the real
ones (``build_scheduler``). Called by the worker shell in place of ``build_engine_parts`` when a
worker runs with ``--simulate``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.engine.builder import EngineParts, build_scheduler, load_tokenizer
from tandem.engine.config import EngineConfig
from tandem.engine.kv_layout import KVLayout
from tandem.engine.model_path import resolve_model_path
from tandem.engine.models.llama import ModelArchConfig
from tandem.engine.models.loader import read_hf_config
from tandem.engine.sim.profile import Profile
from tandem.engine.sim.runner import SimulatedRunner


def check_model_matches(profile: Profile, arch: ModelArchConfig) -> None:
    """ValueError naming every dimension where the model directory differs from the profile."""
    m = profile.model
    diffs = [
        f"{name} (profile {want}, model {got})"
        for name, want, got in (
            ("num_layers", m.num_layers, arch.num_layers),
            ("num_kv_heads", m.num_kv_heads, arch.num_kv_heads),
            ("head_dim", m.head_dim, arch.head_dim),
            ("vocab_size", m.vocab_size, arch.vocab_size),
        )
        if want != got
    ]
    if diffs:
        raise ValueError("the profile was measured on another model: " + ", ".join(diffs))


class TextEncoder:
    """The part of a tokenizer a simulated worker's engine uses: encoding a string prompt."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)


def _encoder(model_path: Path) -> Any:
    fast = model_path / "tokenizer.json"
    return TextEncoder(fast) if fast.is_file() else load_tokenizer(model_path)


def build_simulated_parts(config: EngineConfig, profile: Profile) -> EngineParts:
    """ValueError when the model directory does not match the profile or the cache is too small."""
    model_path = resolve_model_path(config.model)
    hf_config = read_hf_config(model_path)
    arch = ModelArchConfig.from_hf(hf_config)
    check_model_matches(profile, arch)
    tokenizer = _encoder(model_path)
    max_model_len = min(
        config.max_model_len or profile.model.max_model_len, arch.max_position_embeddings
    )
    bs = config.cache.block_size
    num_blocks = config.cache.num_blocks or max(
        1, profile.engine.num_blocks * profile.engine.block_size // bs
    )
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {bs} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; raise num_blocks or lower max_model_len"
        )
    m = profile.model
    layout = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, bs, m.dtype, num_blocks)
    pool, kv, scheduler = build_scheduler(config, layout, max_model_len)
    return EngineParts(
        config=replace(config, dtype=m.dtype),
        model_path=model_path,
        hf_config=hf_config,
        arch=arch,
        tokenizer=tokenizer,
        eos_token_ids=frozenset(profile.model.eos_token_ids),
        max_model_len=max_model_len,
        layout=layout,
        pool=pool,
        kv=kv,
        scheduler=scheduler,
        runner=SimulatedRunner(profile.step, layout, profile.model.sim_token_ids),
        simulated_transfer=profile.transfer,
    )
