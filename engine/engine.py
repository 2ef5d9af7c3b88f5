"""Engine: the step loop tying Scheduler, ModelRunner and output processing together."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.engine.attention.backend import get_backend
from tandem.engine.block_pool import BlockPool, KVEvent
from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.kv_cache_manager import KVCacheManager, cdiv
from tandem.engine.model_runner import KVCacheSpec, ModelRunner
from tandem.engine.models.loader import load_model, parse_dtype, resolve_model_path
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler


@dataclass(slots=True)
class EngineOutput:
    """What one request produced in one step (a delta), or its end."""

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # Prefill role: where the decode worker pulls this request's KV from (wire dict).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int


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


class Engine:
    """Single-threaded: add_request / step / abort are called from one thread (the offline LLM
    loop or a worker's engine thread). Blocks belong to the scheduler's KVCacheManager."""

    def __init__(self, config: EngineConfig) -> None:
        from tandem.engine.models.loader import read_hf_config

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.hf_config = read_hf_config(self.model_path)
        torch.manual_seed(config.seed)
        device = torch.device(config.device)
        dtype = parse_dtype(config.dtype)
        backend_name = config.attention_backend or ("triton" if device.type == "cuda" else "torch")
        self.backend = get_backend(backend_name)
        model = load_model(self.model_path, dtype, config.device, use_kernels=device.type == "cuda")
        arch = model.cfg
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.max_model_len = min(
            config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        cache = config.cache
        bs = cache.block_size
        spec = KVCacheSpec(1, arch.num_layers, bs, arch.num_kv_heads, arch.head_dim, dtype)
        num_blocks = cache.num_blocks or max(1, self._kv_budget(cache, device) // spec.block_bytes)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {bs} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; raise num_blocks or lower max_model_len"
            )
        self.kv_spec = KVCacheSpec(
            num_blocks, arch.num_layers, bs, arch.num_kv_heads, arch.head_dim, dtype
        )
        self.pool = BlockPool(num_blocks, enable_caching=cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, bs, cache.enable_prefix_caching)
        sched_cfg = config.scheduler
        if sched_cfg.max_model_len != self.max_model_len:
            from dataclasses import replace

            sched_cfg = replace(sched_cfg, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.runner = ModelRunner(model, self.backend, self.kv_spec, device)
        self.arch = arch
        if device.type == "cuda" and backend_name == "triton" and not config.enforce_eager:
            self._capture_graphs(sched_cfg.max_num_seqs)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Set by a prefill or decode worker (tandem.kvtransfer.KVConnector); None when colocated.
        self.connector: Any = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @staticmethod
    def _kv_budget(cache: Any, device: torch.device) -> int:
        if device.type != "cuda":
            return cache.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info(device)
        # Leave room for activations and CUDA graphs: 5% of the card beyond what is used now.
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - int(0.05 * total)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{cache.gpu_memory_utilization}"
            )
        return budget

    def _capture_graphs(self, max_num_seqs: int) -> None:
        from tandem.engine.model_runner import DecodeGraphs

        graphs = DecodeGraphs(self.runner, min(max_num_seqs, 256), self.max_model_len)
        graphs.capture()
        self.runner.graphs = graphs

    # ---- requests -----------------------------------------------------------------------------
    def make_requests(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[Request]:
        """Validate and build the n requests of one prompt; nothing is queued yet.

        Raises ValueError naming the offending field; the engine's state is unchanged.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        token_ids = self.encode_prompt(prompt)
        if request_id in self._requests or any(
            f"{request_id}-{i}" in self._requests for i in range(params.n)
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        out = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            out.append(
                Request(
                    rid,
                    list(token_ids),
                    params,
                    eos_token_ids=self.eos_token_ids,
                    block_size=self.kv_spec.block_size,
                    priority=priority,
                    arrival_time=arrival,
                    generator=gen,
                    group_id=request_id,
                    group_index=i,
                    max_tokens=max_tokens,
                )
            )
        return out

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt and at least one generated token must fit)"
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[Request]:
        reqs = self.make_requests(request_id, prompt, params, priority, arrival_time)
        for req in reqs:
            self.enqueue(req)
        return reqs

    def enqueue(self, req: Request) -> None:
        """Queue a built request. A decode-side request (kv_transfer_params set) already holds
        the prefill's first token; its detokenizer consumes it silently, because the prefill
        worker already streamed that text from the same detokenizer state."""
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        if req.output_token_ids:
            detok.append(req.output_token_ids)
        self._requests[req.request_id] = req
        self._detok[req.request_id] = detok
        self.scheduler.add_request(req)
        if req.kv_transfer_params is not None:
            # Keep the prefill's lease alive while the request queues here for blocks.
            self.connector.hold(req.request_id, req.kv_transfer_params)

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        """Abort by request id or group id (n > 1); frees blocks, pinned ones included."""
        wanted = set(request_ids)
        ids = {rid for rid, r in self._requests.items() if rid in wanted or r.group_id in wanted}
        ids |= wanted & self.scheduler.pinned.keys()
        if self.connector is not None:
            sched = self.scheduler
            remote = {r.request_id for r in sched.waiting if r.kv_transfer_params}
            for rid in ids & (sched.pinned.keys() | sched.loading.keys() | remote):
                self.connector.abort(rid)
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._final(r) for r in done]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs = self._poll_connector() if self.connector is not None else []
        sched = self.scheduler.schedule()
        for load in sched.loads:
            failed = self._start_load(load)
            if failed is not None:
                outputs.append(failed)
        if sched.is_empty:
            return outputs
        result = self.runner.execute(sched)
        for s in sched.scheduled:
            if s.request.num_computed_tokens < s.request.num_prompt_tokens:
                self.num_prompt_tokens += min(
                    s.num_new_tokens, s.request.num_prompt_tokens - s.request.num_computed_tokens
                )
        changed = self.scheduler.update(sched, result)
        for req in changed:
            outputs.append(self._process(req, result.logprobs.get(req.request_id)))
        return outputs

    def _poll_connector(self) -> list[EngineOutput]:
        for rid in self.connector.take_released():
            self.scheduler.release_pinned(rid)
        outputs = []
        for res in self.connector.take_finished_loads():
            reason = res.reason.value if res.reason is not None else None
            detail = f"{reason}: {res.detail}" if res.detail else reason
            ended = self.scheduler.finish_load(res.request_id, res.ok, detail)
            if ended is not None and ended.request_id in self._requests:
                outputs.append(self._final(ended))
        return outputs

    def _start_load(self, load: Any) -> EngineOutput | None:
        """Hand a pull to the connector; returns the request's final output if it ended here."""
        req = load.request
        try:
            self.connector.start_load(
                req.request_id, req.kv_transfer_params, load.remote_block_ids, load.local_block_ids
            )
        except ValueError as exc:
            # Nothing was started, so nothing writes the blocks: treat as a failed pull now.
            ended = self.scheduler.finish_load(req.request_id, False, f"invalid transfer: {exc}")
            if ended is not None and ended.request_id in self._requests:
                return self._final(ended)
        return None

    def _process(self, req: Request, logprobs: TokenLogprobs | None) -> EngineOutput:
        token = req.output_token_ids[-1]
        self.num_generation_tokens += 1
        detok = self._detok[req.request_id]
        step = detok.append([token])
        text = step.text_delta
        if step.stop_str is not None:
            req.stop_reason = step.stop_str
            if not req.is_finished:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            else:
                # A stop string outranks length/EOS ending on the same token.
                self.scheduler.release_pinned(req.request_id)
                req.status = RequestStatus.FINISHED_STOPPED
        elif req.is_finished and req.status != RequestStatus.FINISHED_REMOTE_DECODE:
            # Remote decode: the decode worker's detokenizer continues from the same state.
            text += detok.finish()
        out = _output(req, [token], text, [logprobs] if logprobs is not None else [])
        if req.status == RequestStatus.FINISHED_REMOTE_DECODE:
            params = self.connector.publish(
                req.request_id, list(req.block_ids), req.num_prompt_tokens, token
            )
            out.kv_transfer_params = params.to_dict()
        if req.is_finished:
            self._forget(req)
        return out

    def _final(self, req: Request) -> EngineOutput:
        self._forget(req)
        return _output(req, [], "", [])

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)

    # ---- observability ------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running) + len(self.scheduler.loading),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage,
            num_free_blocks=self.pool.num_free_blocks,
            prefix_queried_tokens=self.kv.queried_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.kv_spec.block_size)


def _output(
    req: Request, tokens: list[int], text: str, logprobs: list[TokenLogprobs]
) -> EngineOutput:
    """A request's step output: its delta plus its state (finish reason, counts, error)."""
    return EngineOutput(
        request_id=req.request_id,
        group_id=req.group_id,
        index=req.group_index,
        new_token_ids=tokens,
        text_delta=text,
        finished=req.is_finished,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        error=req.error,
    )
