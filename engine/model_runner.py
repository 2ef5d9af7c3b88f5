"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the KV cache tensor, allocated from the engine's ``KVLayout`` (see kv_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, getitem
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engine import huge_pages
from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.engine.input_batch import BlockTables
from tandem.engine.kv_layout import KVLayout
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, SamplingRow, argmax_only
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.cpu_forward import CpuForward


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Row of the packed hidden states whose logits each sampled request needs.
    sample_rows: torch.Tensor
    sample_requests: list[Request]
    # Every packed row is sampled, in order (a decode-only step): no gather of the rows needed.
    all_rows_sampled: bool = False
    # Every sampled request is greedy without penalties or logprobs (sampler.argmax_only).
    argmax_only: bool = False


@dataclass(slots=True, frozen=True, eq=False)  # compared by identity: it holds arrays
class DecodeRows:
    """What a decode-only step's rows determine besides each request's progress, kept by the
    ModelRunner while the scheduler hands over the same rows: it reuses each running request's
    decode row step after step, so a steady batch is the same list of objects (one C-level
    comparison). Assumes, as the scheduler and sampler do, that a request's SamplingParams do
    not change while it runs."""

    rows: list[ScheduledRequest]
    requests: list[Request]
    index: np.ndarray  # arange(num_seqs), int64: each row's block-table row
    sample_rows: torch.Tensor  # the same, as the tensor of rows whose logits are sampled
    query_start_loc: torch.Tensor  # arange(num_seqs + 1), int32
    argmax_only: bool

    @classmethod
    def of(cls, sched: list[ScheduledRequest]) -> DecodeRows | None:
        """The rows' DecodeRows if every row is one sampled token (a decode-only step)."""
        if not sched or not all(map(_decode_row, sched)):
            return None
        reqs = list(map(_request, sched))
        index = np.arange(len(sched), dtype=np.int64)
        return cls(
            rows=list(sched),
            requests=reqs,
            index=index,
            sample_rows=torch.from_numpy(index),
            query_start_loc=torch.arange(len(sched) + 1, dtype=torch.int32),
            argmax_only=argmax_only(_distinct_params(reqs)),
        )


def _decode_row(row: ScheduledRequest) -> bool:
    return row.num_new_tokens == 1 and row.sample


def _distinct_params(reqs: list[Request]) -> list[SamplingParams]:
    """Requests often share one SamplingParams: each distinct one is checked once."""
    params = list(map(_params, reqs))
    return list(dict(zip(map(id, params), params, strict=True)).values())


# Field readers for prepare()'s C-level maps over the step's rows.
_request = attrgetter("request")
_num_new = attrgetter("num_new_tokens")
_sample = attrgetter("sample")
_computed = attrgetter("num_computed_tokens")
_block_ids = attrgetter("block_ids")
_all_tokens = attrgetter("all_token_ids")
_params = attrgetter("params")
_request_id = attrgetter("request_id")


class ModelRunner:
    """Owned by the Engine. Owns the model, the KV cache tensor and the sampler."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        layout: KVLayout,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.layout = layout
        self.device = device
        # Zeroed, not empty: padded attention reads unused slots under a mask, and NaN * 0 = NaN.
        # On a CPU host its pages are huge where the OS allows (engine/huge_pages.py).
        if device.type == "cpu":
            self.kv_cache, _ = huge_pages.zeros(layout.shape, layout.torch_dtype)
        else:
            self.kv_cache = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
        self.sampler = Sampler()
        self.block_tables = BlockTables()
        self.graphs: DecodeGraphs | None = None
        # CPU, float32: the whole step in one C call (engine/cpu_forward.py), set by the builder.
        self.cpu_forward: CpuForward | None = None
        self._on_cpu = device.type == "cpu"
        self._decode_rows: DecodeRows | None = None

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Build the packed inputs for one step (pure bookkeeping on the host).

        A decode-only step (one token per row, the steady state) reads each request's fields
        with C-level ``map``s (no Python frame per request) and does the rest in numpy; while
        the scheduler hands over the same rows as last step, what the rows alone determine is
        reused (``DecodeRows``). Steps with prefill chunks go row by row.
        """
        sched = out.scheduled
        rows = self._decode_rows
        if rows is None or sched != rows.rows:  # C-level: the same row objects, same order
            rows = DecodeRows.of(sched)
            self._decode_rows = rows
        if rows is not None:
            return self._decode_inputs(rows)
        return self._mixed_inputs(sched)

    def _decode_inputs(self, rows: DecodeRows) -> StepInputs:
        bs = self.layout.block_size
        reqs = rows.requests
        num_seqs = len(reqs)
        starts = list(map(_computed, reqs))
        tables = list(map(_block_ids, reqs))
        block_tables = self.block_tables.build(tables, max(map(len, tables)))
        ids = np.array(list(map(getitem, map(_all_tokens, reqs), starts)), dtype=np.int64)
        pos = np.array(starts, dtype=np.int64)
        blk, off = np.divmod(pos, bs)
        slots = block_tables[rows.index, blk].astype(np.int64) * bs + off
        context = pos.astype(np.int32)
        slens = (pos + 1).tolist()
        dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=dev(torch.from_numpy(slots)),
            query_start_loc=dev(rows.query_start_loc),
            seq_lens=dev(torch.from_numpy(context + 1)),
            context_lens=dev(torch.from_numpy(context)),
            block_tables=dev(torch.from_numpy(block_tables)),
            max_query_len=1,
            max_seq_len=max(slens),
            query_lens_cpu=[1] * num_seqs,
            seq_lens_cpu=slens,
        )
        return StepInputs(
            input_ids=dev(torch.from_numpy(ids)),
            positions=dev(torch.from_numpy(pos)),
            meta=meta,
            sample_rows=dev(rows.sample_rows),
            sample_requests=reqs,
            all_rows_sampled=True,
            argmax_only=rows.argmax_only,
        )

    def _mixed_inputs(self, sched: list[ScheduledRequest]) -> StepInputs:
        bs = self.layout.block_size
        reqs = list(map(_request, sched))
        qlens = list(map(_num_new, sched))
        starts = list(map(_computed, reqs))
        tables = list(map(_block_ids, reqs))
        block_tables = self.block_tables.build(tables, max(map(len, tables)))
        flags = list(map(_sample, sched))
        sample_reqs = list(compress(reqs, flags))
        id_list, pos_list, slot_list, row_list = _packed_rows(sched, bs)
        ids, pos = np.array(id_list, dtype=np.int64), np.array(pos_list, dtype=np.int64)
        slots, sample_rows = np.array(slot_list, dtype=np.int64), np.array(row_list, np.int64)
        slens = [c + n for c, n in zip(starts, qlens, strict=True)]
        seq_lens = torch.tensor(slens, dtype=torch.int32)
        query_lens = torch.tensor(qlens, dtype=torch.int32)
        query_start_loc = torch.zeros(len(sched) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=dev(torch.from_numpy(slots)),
            query_start_loc=dev(query_start_loc),
            seq_lens=dev(seq_lens),
            context_lens=dev(seq_lens - query_lens),
            block_tables=dev(torch.from_numpy(block_tables)),
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
        )
        return StepInputs(
            input_ids=dev(torch.from_numpy(ids)),
            positions=dev(torch.from_numpy(pos)),
            meta=meta,
            sample_rows=dev(torch.from_numpy(sample_rows)),
            sample_requests=sample_reqs,
            all_rows_sampled=len(sample_rows) == len(ids),
            argmax_only=argmax_only(_distinct_params(sample_reqs)),
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._on_cpu else t.to(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, inputs: StepInputs | None = None) -> ModelRunnerOutput:
        """Called by the Engine once per non-empty step (inputs: a prepare() already done)."""
        inputs = inputs or self.prepare(out)
        if self.graphs is not None and self.graphs.accepts(inputs.meta):
            hidden = self.graphs.run(inputs)
        elif self.cpu_forward is not None and self.cpu_forward.accepts(inputs):
            hidden = self.cpu_forward.run(inputs)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend
            )
        result = ModelRunnerOutput()
        if not inputs.sample_requests:
            return result
        logits = self.model.compute_logits(
            hidden if inputs.all_rows_sampled else hidden[inputs.sample_rows]
        )
        reqs = inputs.sample_requests
        if inputs.argmax_only:
            # All greedy without penalties or logprobs (the common batch): no SamplingRows.
            tokens = self.sampler.greedy(logits)
            result.sampled_token_ids = tokens
            return result
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
            )
            for r in reqs
        ]
        sampled = self.sampler(logits, rows)
        result.sampled_token_ids = sampled.token_ids
        result.logprobs = dict(zip(map(_request_id, reqs), sampled.logprobs, strict=True))
        return result


def _packed_rows(
    sched: list[ScheduledRequest], bs: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Token ids, positions and KV slots of every row of a step with prefill chunks, and the
    packed row whose logits each sampled request needs."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    for s in sched:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        table = req.block_ids
        if s.num_new_tokens == 1:
            ids.append(req.all_token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids.extend(req.all_token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
        if s.sample:
            sample_rows.append(len(ids) - 1)
    return ids, positions, slots, sample_rows


def graph_decode_splits(
    batch_size: int, num_kv_heads: int, max_model_len: int, device: torch.device
) -> int:
    """Decode attention's split count for the graph of ``batch_size`` sequences, fixed at capture
    for every context a replay holds: about 64 programs per KV head, whatever the context. The
    eager path's rule at ``max_model_len`` is the candidate that ``benchmarks/graph_splits_gpu.py``
    times against this one on a GPU; no run has measured it yet."""
    return max(1, 64 // batch_size)


class DecodeGraphs:
    """CUDA graphs of decode-only steps at padded batch sizes (the Triton backend on CUDA).

    Built by the Engine after the KV cache exists (graphs bake in its address). Each captured size
    uses a fixed split-K factor (``graph_decode_splits``) and max_seq_len = max_model_len, so one
    graph is right for any sequence lengths. tests/test_engine_gpu.py holds graph replays to the
    eager path.
    """

    def __init__(self, runner: ModelRunner, max_batch_size: int, max_model_len: int) -> None:
        from tandem.engine.attention.triton_backend import TritonAttentionBackend
        from tandem.kernels.cuda_graph import DecodeGraphRunner, GraphInput

        self.runner = runner
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // runner.layout.block_size)
        self.max_batch_size = max_batch_size
        self._backends = {}
        self._arange = torch.arange(max_batch_size + 1, dtype=torch.int32, device=runner.device)
        inputs = [
            GraphInput("input_ids", (), torch.int64, 0),
            GraphInput("positions", (), torch.int64, 0),
            GraphInput("slot_mapping", (), torch.int64, -1),
            GraphInput("seq_lens", (), torch.int32, 0),
            GraphInput("block_tables", (self.max_blocks,), torch.int32, 0),
        ]
        self.graph_runner = DecodeGraphRunner(self._forward, inputs, max_batch_size, runner.device)
        heads = runner.layout.num_kv_heads
        for size in self.graph_runner.batch_sizes:
            # Few sequences: split the context across more programs to fill the GPU.
            splits = graph_decode_splits(size, heads, max_model_len, runner.device)
            self._backends[size] = TritonAttentionBackend(decode_num_splits=splits)

    def _forward(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        b = views["input_ids"].shape[0]
        seq_lens = views["seq_lens"]
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=self._arange[: b + 1],
            seq_lens=seq_lens,
            context_lens=seq_lens - 1,
            block_tables=views["block_tables"],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,
        )
        from tandem.kernels.cuda_graph import padded_batch_size

        size = padded_batch_size(b, self.graph_runner.batch_sizes) or b
        backend = self._backends.get(size, self.runner.backend)
        return self.runner.model(
            views["input_ids"], views["positions"], self.runner.kv_cache, meta, backend
        )

    def capture(self) -> None:
        self.graph_runner.capture()

    def accepts(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.max_batch_size

    def run(self, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.meta
        tables = torch.zeros(
            (meta.num_seqs, self.max_blocks), dtype=torch.int32, device=self.runner.device
        )
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        return self.graph_runner.run(
            {
                "input_ids": inputs.input_ids,
                "positions": inputs.positions,
                "slot_mapping": meta.slot_mapping,
                "seq_lens": meta.seq_lens,
                "block_tables": tables,
            }
        ).clone()
