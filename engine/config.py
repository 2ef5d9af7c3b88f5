"""Narrow configs: each component takes only its own."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    # A waiting request gains one priority level per this many steps it waits: no starvation.
    aging_steps: int = 256
    # Off: a prompt is only admitted when it fits in one step's token budget.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "aging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly this many blocks when set; otherwise sized from kv_cache_memory_bytes.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    # On CUDA: the fraction of the GPU's memory the weights, activations and KV cache may use;
    # the KV cache gets what the loaded model leaves of it (as in vLLM). Ignored on CPU.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Host-memory KV tier (pinned on CUDA): evicted prefix blocks and swapped-out requests go
    # there instead of being dropped or recomputed. 0 = off.
    kv_offload_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if type(self.kv_offload_bytes) is not int or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be an int >= 0, got {self.kv_offload_bytes!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = "demo"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Disable CUDA graphs on GPU and the fused one-call forward on CPU (engine/cpu_forward.py).
    enforce_eager: bool = False
    # The CPU kernels (tandem.kernels.cpu_ops, built at first use) for float32 on CPU; False, or
    # a machine where they cannot be built, keeps the PyTorch path.
    cpu_kernels: bool = True
