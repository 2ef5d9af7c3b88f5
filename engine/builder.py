"""Engine start-up: load the model and tokenizer, size the KV cache, build pool, scheduler and
runner. Called once per process (by ``Engine`` or, for workers, by the worker shell on a thread,
so the role can build its connector over the KV cache before the engine exists).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tandem.engine.attention import get_backend
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_layout import KVLayout, dtype_name
from tandem.engine.kv_tier import KVTier
from tandem.engine.memory_profile import blocks_for, kv_cache_bytes, profile_cuda, summary
from tandem.engine.model_path import resolve_model_path
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.llama import ModelArchConfig
from tandem.engine.models.loader import load_model, parse_dtype, read_hf_config
from tandem.engine.runner import StepRunner
from tandem.engine.scheduler import Scheduler
from tandem.engine.sim.cost_model import TransferCost
from tandem.engine.tier_copier import TierCopier
from tandem.kernels import cpu_ops

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """Everything an Engine runs on; owned by the Engine once it is built from them."""

    config: EngineConfig
    model_path: Path
    hf_config: dict[str, Any]
    arch: ModelArchConfig
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    layout: KVLayout
    pool: BlockPool
    kv: KVCacheManager
    scheduler: Scheduler
    runner: StepRunner
    # The host KV tier's copier (kv_offload_bytes > 0); the tier itself is ``kv.tier``.
    copier: TierCopier | None = None
    # Simulated workers (``--simulate``): KV transfers wait this profiled time, move no bytes.
    simulated_transfer: TransferCost | None = None


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(path: Path, hf_config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json, then config.json, then the tokenizer."""
    gen = path / "generation_config.json"
    value = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if value is None:
        value = hf_config.get("eos_token_id")
    if value is None:
        value = tokenizer.eos_token_id
    if value is None:
        return frozenset()
    return frozenset(value if isinstance(value, list) else [value])


def parse_device(name: str) -> torch.device:
    """A torch device this machine has; ValueError naming the device otherwise (before any
    weights load, so `--device cuda` on a CPU-only machine is one line, not a traceback)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {name!r} is not a torch device: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: the engine runs on cpu or cuda only")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r}: this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s)")
    return device


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Load and size everything; ValueError naming the problem (bad model, too small a cache)."""
    model_path = resolve_model_path(config.model)
    hf_config = read_hf_config(model_path)
    torch.manual_seed(config.seed)
    device = parse_device(config.device)
    dtype = parse_dtype(config.dtype)
    backend_name = config.attention_backend or ("triton" if device.type == "cuda" else "torch")
    backend = get_backend(backend_name, cpu_kernels=config.cpu_kernels)
    on_cuda = device.type == "cuda"
    model = load_model(
        model_path, dtype, config.device, use_kernels=on_cuda, cpu_kernels=config.cpu_kernels
    )
    arch = model.cfg
    tokenizer = load_tokenizer(model_path)
    max_model_len = min(
        config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
    )
    cache = config.cache
    bs = cache.block_size
    one = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, bs, dtype_name(dtype), 1)
    sched_cfg = config.scheduler
    if cache.num_blocks:
        num_blocks, source = cache.num_blocks, "num_blocks"
    elif device.type == "cuda":
        # Measured, as vLLM does: the peak of one full dummy step, not a guess.
        profile = profile_cuda(
            model, backend, one, device, sched_cfg.max_num_batched_tokens, max_model_len,
            sched_cfg.max_num_seqs,
        )  # fmt: skip
        budget = kv_cache_bytes(profile, cache.gpu_memory_utilization)
        num_blocks = max(1, blocks_for(budget, one.block_bytes))
        source = (
            f"profiled: peak {profile.peak_bytes / 2**30:.2f} GiB of "
            f"{profile.total_bytes / 2**30:.2f} GiB at gpu_memory_utilization="
            f"{cache.gpu_memory_utilization}"
        )
    else:
        num_blocks = max(1, blocks_for(cache.kv_cache_memory_bytes, one.block_bytes))
        source = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    log.info("%s", summary(num_blocks, bs, max_model_len, source))
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {bs} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; raise num_blocks or lower max_model_len"
        )
    layout = one.with_num_blocks(num_blocks)
    num_host = cache.kv_offload_bytes // one.block_bytes
    if cache.kv_offload_bytes and num_host < 1:
        raise ValueError(
            f"kv_offload_bytes={cache.kv_offload_bytes} is less than one KV block "
            f"({one.block_bytes} bytes); use 0 to turn the host tier off"
        )
    tier = KVTier(num_host, cache.enable_prefix_caching) if num_host else None
    pool, kv, scheduler = build_scheduler(config, layout, max_model_len, tier)
    sched_cfg = scheduler.config
    runner = ModelRunner(model, backend, layout, device)
    copier = TierCopier(runner.kv_cache, num_host) if num_host else None
    if device.type == "cuda" and backend_name == "triton" and not config.enforce_eager:
        _capture_graphs(runner, sched_cfg.max_num_seqs, max_model_len)
    fused_ok = backend_name == "torch" and config.cpu_kernels and not config.enforce_eager
    if device.type == "cpu" and fused_ok and cpu_ops.available():
        from tandem.engine.cpu_forward import CpuForward

        runner.cpu_forward = CpuForward.build(
            model, runner.kv_cache, sched_cfg.max_num_batched_tokens
        )
    return EngineParts(
        config=config,
        model_path=model_path,
        hf_config=hf_config,
        arch=arch,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(model_path, hf_config, tokenizer),
        max_model_len=max_model_len,
        layout=layout,
        pool=pool,
        kv=kv,
        scheduler=scheduler,
        runner=runner,
        copier=copier,
    )


def build_scheduler(
    config: EngineConfig, layout: KVLayout, max_model_len: int, tier: KVTier | None = None
) -> tuple[BlockPool, KVCacheManager, Scheduler]:
    """The block pool, KV cache manager (with the host tier, if any) and scheduler over
    ``layout.num_blocks`` blocks (shared by the real and the simulated builder)."""
    cache = config.cache
    pool = BlockPool(layout.num_blocks, enable_caching=cache.enable_prefix_caching)
    kv = KVCacheManager(pool, layout.block_size, cache.enable_prefix_caching, tier)
    sched_cfg = config.scheduler
    if sched_cfg.max_model_len != max_model_len:
        sched_cfg = replace(sched_cfg, max_model_len=max_model_len)
    check_unchunked_budget(sched_cfg)
    return pool, kv, Scheduler(sched_cfg, kv)


def check_unchunked_budget(cfg: SchedulerConfig) -> None:
    """Without chunked prefill a prompt runs in one step, so a prompt longer than the step's token
    budget could never be admitted and would wait forever: refuse the configuration (as vLLM
    does) rather than accept requests that never finish."""
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        raise ValueError(
            f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len, got "
            f"{cfg.max_num_batched_tokens} < {cfg.max_model_len}: a longer prompt could never be "
            "scheduled; raise max_num_batched_tokens, lower max_model_len or enable chunked prefill"
        )


def _capture_graphs(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
    from tandem.engine.model_runner import DecodeGraphs

    graphs = DecodeGraphs(runner, min(max_num_seqs, 256), max_model_len)
    graphs.capture()
    runner.graphs = graphs
