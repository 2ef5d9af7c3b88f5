"""Load a Hugging Face Llama-family checkpoint from a local directory (never from a hub)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.models.llama import LlamaForCausalLM, ModelArchConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {name!r}") from None


def read_hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    return files


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def load_model(
    path: Path, dtype: torch.dtype, device: str, use_kernels: bool, cpu_kernels: bool = False
) -> LlamaForCausalLM:
    """Build the model from config.json and fill every parameter; a missing weight is an error.

    use_kernels: Triton kernels (CUDA); cpu_kernels: the CPU kernels where they apply."""
    cfg = ModelArchConfig.from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, use_kernels=use_kernels, cpu_kernels=cpu_kernels).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # The rotary table stays float32, as in HF, whatever the weights' dtype.
    model.rope_cache = _rope_for(cfg).to(device)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    qkv_parts = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_offsets = [(0, q), (q, kv), (q + kv, kv)]
    inter = cfg.intermediate_size

    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                target, rows = _map_name(name, qkv_parts, qkv_offsets, inter)
                if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if target not in params:
                    raise ValueError(f"unexpected weight {name} for {cfg.architecture}")
                param = params[target]
                with torch.no_grad():
                    dest = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
                    if dest.shape != tensor.shape:
                        raise ValueError(
                            f"weight {name}: shape {tuple(tensor.shape)}, "
                            f"expected {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor.to(dtype))
                filled.add(target if rows is None else f"{target}[{rows[0]}]")
    expected = _expected_fills(params, cfg, qkv_offsets, inter)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(missing[:5])}")
    return model.eval()


def _rope_for(cfg: ModelArchConfig) -> torch.Tensor:
    from tandem.kernels.rope_cache import compute_cos_sin_cache as cos_sin_cache

    return cos_sin_cache(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
    )


def _map_name(
    name: str, qkv_parts: dict[str, int], qkv_offsets: list[tuple[int, int]], inter: int
) -> tuple[str | None, tuple[int, int] | None]:
    """HF parameter name -> (our parameter name, row slice of a fused parameter or None)."""
    if name.startswith("model.embed_tokens."):
        return name.removeprefix("model."), None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return name, None
    m = _LAYER.fullmatch(name)
    if m is None:
        return None, None  # e.g. rotary inv_freq buffers in old checkpoints
    layer, rest = m.groups()
    prefix = f"layers.{layer}."
    for part, idx in qkv_parts.items():
        if rest.startswith(f"self_attn.{part}."):
            kind = rest.rsplit(".", 1)[1]
            return prefix + f"self_attn.qkv_proj.{kind}", qkv_offsets[idx]
    if rest.startswith("mlp.gate_proj."):
        return prefix + "mlp.gate_up_proj.weight", (0, inter)
    if rest.startswith("mlp.up_proj."):
        return prefix + "mlp.gate_up_proj.weight", (inter, inter)
    if "rotary_emb" in rest:
        return None, None
    return prefix + rest, None


def _expected_fills(
    params: dict[str, torch.nn.Parameter],
    cfg: ModelArchConfig,
    qkv_offsets: list[tuple[int, int]],
    inter: int,
) -> set[str]:
    out: set[str] = set()
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out.update(f"{name}[{off}]" for off, _ in qkv_offsets)
        elif name.endswith("gate_up_proj.weight"):
            out.update({f"{name}[0]", f"{name}[{inter}]"})
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out.add(name)
    return out
