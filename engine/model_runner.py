"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.attention.backend import AttentionBackend, AttentionMetadata
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.scheduler import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def block_bytes(self) -> int:
        per_block = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return per_block * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Row of the packed hidden states whose logits each sampled request needs.
    sample_rows: torch.Tensor
    sample_request_ids: list[str]


class ModelRunner:
    """Owned by the Engine. Owns the model, the KV cache tensor and the sampler."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        spec: KVCacheSpec,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.spec = spec
        self.device = device
        # Zeroed, not empty: padded attention reads unused slots under a mask, and NaN * 0 = NaN.
        self.kv_cache = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        self.sampler = Sampler()

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Build the packed inputs for one step (pure bookkeeping on the host)."""
        bs = self.spec.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        max_blocks = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(req.all_token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(req.block_ids, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            qlens.append(s.num_new_tokens)
            slens.append(end)
            max_blocks = max(max_blocks, len(req.block_ids))
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(req.request_id)
        block_tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(out.scheduled):
            block_tables[i, : len(s.request.block_ids)] = s.request.block_ids
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        dev = self.device
        seq_lens = torch.tensor(slens, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=seq_lens.to(dev),
            context_lens=(seq_lens - torch.tensor(qlens, dtype=torch.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_request_ids=sample_ids,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Called by the Engine once per non-empty step."""
        inputs = self.prepare(out)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend
        )
        result = ModelRunnerOutput()
        if not inputs.sample_request_ids:
            return result
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
            )
            for r in (by_id[rid] for rid in inputs.sample_request_ids)
        ]
        sampled = self.sampler(logits, rows)
        for rid, tok, lp in zip(
            inputs.sample_request_ids, sampled.token_ids, sampled.logprobs, strict=True
        ):
            result.sampled_token_ids[rid] = tok
            result.logprobs[rid] = lp
        return result
