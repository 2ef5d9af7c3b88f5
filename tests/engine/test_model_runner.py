"""ModelRunner.prepare: a decode-only step reuses what its rows determine (DecodeRows) while the
scheduler hands over the same rows, and its inputs equal the general path's, step by step,
through requests joining, leaving and a step with a prefill chunk."""

from __future__ import annotations

import torch

from tandem.engine.engine import Engine
from tandem.engine.llm import build_engine_config
from tandem.engine.model_runner import DecodeRows, ModelRunner, StepInputs
from tandem.engine.outputs import SchedulerOutput
from tandem.engine.sampling_params import SamplingParams


def same_inputs(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
        assert torch.equal(getattr(a.meta, name), getattr(b.meta, name)), name
    assert a.meta.max_query_len == b.meta.max_query_len
    assert a.meta.max_seq_len == b.meta.max_seq_len
    assert a.meta.query_lens_cpu == b.meta.query_lens_cpu
    assert a.meta.seq_lens_cpu == b.meta.seq_lens_cpu
    assert a.sample_requests == b.sample_requests
    assert (a.all_rows_sampled, a.argmax_only) == (b.all_rows_sampled, b.argmax_only)


def test_decode_steps_reuse_their_rows_and_match_the_general_path() -> None:
    engine = Engine(build_engine_config("demo", num_blocks=64))
    runner = engine.runner
    kinds: list[str] = []
    seen: list[DecodeRows | None] = []
    real = ModelRunner.prepare

    def checked(out: SchedulerOutput) -> StepInputs:
        got = real(runner, out)
        same_inputs(got, runner._mixed_inputs(out.scheduled))
        rows = runner._decode_rows
        kinds.append("mixed" if rows is None else "reused" if rows in seen else "decode")
        seen.append(rows)
        return got

    runner.prepare = checked  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [256, 5, 6, 7], greedy)
    engine.add_request(
        "b", [256, 8, 9], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    engine.add_request(
        "c",
        [256, 1, 2, 3, 4],
        SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True),
    )
    while engine.has_unfinished:
        engine.step()
    # a, b: prompts (mixed), then decodes: new rows, then reused. c's 5-token prompt joins (mixed);
    # a, b, c decode: new rows, reused; a (6 tokens) and c (3) end there: b alone, new rows, ...
    assert kinds == ["mixed", "decode", "reused", "mixed", "decode", "reused", "decode",
                     "reused", "reused"]  # fmt: skip
    # c samples at temperature 0.8: a batch with it is not argmax-only.
    assert [r is not None and r.argmax_only for r in seen] == [
        False, True, True, False, False, False, True, True, True,
    ]  # fmt: skip
    assert engine.pool.num_free_blocks == 64
