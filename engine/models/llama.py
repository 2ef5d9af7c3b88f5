"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over paged KV, for packed variable-length input.

Inputs are flattened: ``input_ids``/``positions`` are [num_tokens]; the attention backend knows
from the step's AttentionMetadata which tokens belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.backend import AttentionBackend, AttentionMetadata
from tandem.kernels.refs import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from tandem.kernels.rope_cache import compute_cos_sin_cache as cos_sin_cache

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(slots=True, frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    # Per layer: 0 for full attention, else the sliding window (Mistral; Qwen2/3 with
    # use_sliding_window). Empty means full attention everywhere.
    sliding_windows: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=act,
            sliding_windows=_sliding_windows(arch, cfg),
        )


def _sliding_windows(arch: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window as transformers reads the config: ``layer_types`` when present, else
    Mistral's ``sliding_window`` on every layer, else Qwen2/3's ``use_sliding_window`` on layers
    from ``max_window_layers`` on. Llama has none. () when no layer has a window."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window"):
        window = None
    if arch == "LlamaForCausalLM" or not window:
        return ()
    if isinstance(window, int) and window >= cfg.get("max_position_embeddings", 2048):
        return ()  # no sequence can outgrow it
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif arch == "MistralForCausalLM":
        windows = (window,) * layers
    else:
        first = cfg.get("max_window_layers", layers)
        windows = tuple(window if i >= first else 0 for i in range(layers))
    return windows if any(windows) else ()


class FusedOps:
    """The model's pointwise ops, called by every layer: Triton kernels on CUDA when enabled, the
    CPU kernels (:mod:`tandem.kernels.cpu_ops`) for float32 CPU tensors when ``cpu_kernels`` and
    they could be built, otherwise their PyTorch references (:mod:`tandem.kernels.refs`)."""

    def __init__(self, use_kernels: bool, cpu_kernels: bool = False) -> None:
        self.use_kernels = use_kernels
        self.cpu_kernels = False
        if use_kernels:
            # From their modules, not through the package: once any code has imported the
            # module tandem.kernels.rms_norm, the package's attribute of that name is the
            # module, not the function its lazy __getattr__ gives ("'module' object is not
            # callable", found on the first GPU run).
            from tandem.kernels.activation import silu_and_mul
            from tandem.kernels.rms_norm import rms_norm
            from tandem.kernels.rotary import rotary_embedding

            self._rms_norm = rms_norm
            self._rotary = rotary_embedding
            self._silu_and_mul = silu_and_mul
        elif cpu_kernels:
            from tandem.kernels import cpu_ops

            self._cpu = cpu_ops
            self.cpu_kernels = cpu_ops.available()

    def _native(self, x: torch.Tensor) -> bool:
        return self.cpu_kernels and x.dtype == torch.float32 and x.device.type == "cpu"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.use_kernels:
            return self._rms_norm(x, weight, eps, residual)
        if self._native(x):
            return self._cpu.cpu_rms_norm(x, weight, eps, residual)
        return rms_norm_ref(x, weight, eps, residual)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k in place (all paths) and returns them; q and k may be strided views
        of the fused projection on the CPU-kernel path, and must be contiguous otherwise."""
        if self.use_kernels:
            self._rotary(positions, q, k, cache)
        elif self._native(q):
            self._cpu.cpu_rotary_embedding(positions, q, k, cache)
        else:
            # Rounded per op in the model dtype as in Hugging Face (the kernel rounds once from
            # fp32); the two agree bit for bit in fp32.
            rotary_embedding_ref(positions, q, k, cache, compute_dtype=q.dtype)
        return q, k

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] @ weight^T: the few-row CPU kernel up to ``LINEAR_MAX_ROWS`` rows (it
        streams the weights faster than the BLAS), ``F.linear`` otherwise."""
        if self._native(x) and x.shape[0] <= self._cpu.LINEAR_MAX_ROWS and x.dim() == 2:
            return self._cpu.cpu_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return self._silu_and_mul(x)
        if self._native(x):
            return self._cpu.cpu_silu_and_mul(x)
        # Per-op rounding in the model dtype, as in Hugging Face; see rotary.
        return silu_and_mul_ref(x, compute_dtype=x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: FusedOps, window: int = 0) -> None:
        super().__init__()
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].reshape(k.shape)
        if not self.ops.cpu_kernels:
            q, k = q.contiguous(), k.contiguous()
        q, k = self.ops.rotary(positions, q, k, rope_cache)
        out = backend.forward(
            q, k, v, kv_layer[:, 0], kv_layer[:, 1], meta, self.scale, window=self.window
        )
        return self.ops.linear(out.reshape(t, self.q_size), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: FusedOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_proj.weight)
        return self.ops.linear(self.ops.silu_and_mul(gate_up), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: FusedOps, window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)


class LlamaForCausalLM(nn.Module):
    """Called by the ModelRunner: ``forward`` for hidden states, ``compute_logits`` for the
    positions that are sampled."""

    def __init__(
        self, cfg: ModelArchConfig, use_kernels: bool = False, cpu_kernels: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops = FusedOps(use_kernels, cpu_kernels)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, ops, cfg.window(i)) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "rope_cache",
            cos_sin_cache(
                cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
            ),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        # Submodules' forward() directly: nn.Module.__call__ (hooks machinery) costs a few
        # microseconds per call, which at batch 1 is a visible share of a decode step.
        h = F.embedding(input_ids, self.embed_tokens.weight)
        residual: torch.Tensor | None = None
        rope = self.rope_cache
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                h, _ = layer.input_layernorm.forward(h)
            else:
                h, residual = layer.input_layernorm.forward(h, residual)
            h = layer.self_attn.forward(h, positions, rope, kv_cache[:, i], meta, backend)
            h, residual = layer.post_attention_layernorm.forward(h, residual)
            h = layer.mlp.forward(h)
        h, _ = self.norm.forward(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head.weight).float()
