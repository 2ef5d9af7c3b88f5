"""CpuForward: the whole model step in one C call on CPU, the counterpart of the GPU's DecodeGraphs.

Built by the engine builder when the model runs in float32 on CPU with the CPU kernels available
(``cpu_kernels=True``, the default) and ``enforce_eager`` is off; ``ModelRunner.execute`` then runs
every step of at most ``max_tokens`` tokens through it (decode, prefill chunks and mixed batches
alike: the C forward takes packed rows, so nothing is padded and nothing is captured per batch
size). Larger steps, other dtypes and a torch without an exported sgemm_ keep the eager model,
which itself runs on the CPU kernels. tests/engine/test_cpu_forward.py holds it to the eager model
and, through the parity tests, to Hugging Face.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tandem.kernels.cpu_forward import FusedLlamaForward, LayerWeights, sgemm_address

if TYPE_CHECKING:
    from tandem.engine.model_runner import StepInputs
    from tandem.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Scratch (eight activations per token row) stays under this; bigger steps run eagerly.
SCRATCH_BYTES = 64 * 1024 * 1024


class CpuForward:
    """Owned by the ModelRunner; holds the model's weights and the KV cache by reference."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_tokens: int) -> None:
        cfg = model.cfg
        layers = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv_w=attn.qkv_proj.weight.detach(),
                    qkv_b=None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach(),
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
                    o_w=attn.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up_w=mlp.gate_up_proj.weight.detach(),
                    down_w=mlp.down_proj.weight.detach(),
                    window=cfg.window(i),
                )
            )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        row_bytes = 4 * (4 * cfg.hidden_size + 2 * q + 2 * kv + 3 * cfg.intermediate_size)
        self.max_tokens = max(1, min(max_tokens, SCRATCH_BYTES // row_bytes))
        self.fused = FusedLlamaForward(
            embed=model.embed_tokens.weight.detach(),
            final_norm=model.norm.weight.detach(),
            cos_sin=model.rope_cache,
            kv_cache=kv_cache,
            layers=layers,
            num_heads=cfg.num_heads,
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            max_tokens=self.max_tokens,
        )

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_tokens: int
    ) -> CpuForward | None:
        """The fused forward where it applies (float32 on CPU, kernels built, sgemm_ found),
        else None; a missing sgemm_ is logged once, the other cases are plain configuration."""
        if kv_cache.dtype != torch.float32 or kv_cache.device.type != "cpu":
            return None
        if model.embed_tokens.weight.dtype != torch.float32:
            return None
        if sgemm_address() is None:
            log.warning("torch exports no sgemm_; the fused CPU forward is off (eager steps)")
            return None
        return cls(model, kv_cache, max_tokens)

    def accepts(self, inputs: StepInputs) -> bool:
        return 0 < inputs.input_ids.shape[0] <= self.max_tokens

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden] (a view valid until the next run)."""
        meta = inputs.meta
        decode = meta.is_decode_only and inputs.input_ids.shape[0] == meta.num_seqs
        return self.fused(
            inputs.input_ids,
            inputs.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            None if decode else meta.query_start_loc,
        )
