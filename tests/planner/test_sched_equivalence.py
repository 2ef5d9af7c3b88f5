"""The simulator's scheduling decisions equal the real engine's for the same inputs: the same
scheduler code, fed the same requests, schedules the same chunks, decodes and preemptions step
for step (the real engine runs the demo model; the simulated worker only the cost model)."""

from __future__ import annotations

import random

from sim_profiles import synthetic_profile

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import Engine
from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.sampling_params import SamplingParams
from tandem.planner.events import EventLoop
from tandem.planner.sim_kv import KVFabric
from tandem.planner.sim_worker import SimWorker, WorkerCallbacks

MAX_TOKENS = 12
NUM_BLOCKS = 24  # 384 token slots for ~750 tokens of prompts: preemption must happen
BUDGET = 64  # prompts over 64 tokens are chunked


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in (20, 150, 33, 200, 64, 90, 7, 180)]


class Recording:
    def __init__(self, inner) -> None:  # noqa: ANN001 - the engine's runner
        self.inner = inner
        self.device = inner.device
        self.kv_cache = inner.kv_cache
        self.steps: list[list[tuple[str, int]]] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return self.inner.execute(out)


def real_schedule() -> tuple[list[list[tuple[str, int]]], int]:
    config = EngineConfig(
        model="demo",
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=6),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
    )
    engine = Engine(config)
    rec = Recording(engine.runner)
    engine.runner = rec
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished:
        engine.step()
    engine.check_integrity()
    return rec.steps, engine.scheduler.num_preemptions


def simulated_schedule() -> tuple[list[list[tuple[str, int]]], int]:
    profile = synthetic_profile()
    loop = EventLoop()
    fabric = KVFabric(loop, lambda n: 0.0, profile.engine.block_bytes)
    ignore = WorkerCallbacks(lambda *_: None, lambda *_: None, lambda *_: None)
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=6, max_model_len=256)
    worker = SimWorker(loop, "w", Role.COLOCATED, profile.step, config, NUM_BLOCKS, 16,
                       profile.model.sim_token_ids, fabric, ignore)  # fmt: skip
    worker.history = []
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts()):
        # Arrival order breaks scheduling ties (FCFS, latest-arrival preemption), as in the
        # real engine, whose requests arrive one after another.
        worker.submit(Request(f"r{i}", p, params, eos_token_ids=frozenset([257]), block_size=16,
                              arrival_time=i * 1e-3, max_tokens=MAX_TOKENS))  # fmt: skip
    loop.run()
    worker.kv.check_integrity()
    assert worker.pool.num_free_blocks == NUM_BLOCKS
    return worker.history, worker.scheduler.num_preemptions


def test_simulated_worker_schedules_exactly_as_the_real_engine() -> None:
    real, real_preemptions = real_schedule()
    sim, sim_preemptions = simulated_schedule()
    assert real_preemptions > 0  # the case exercises preemption, not only chunking
    chunks = [rid for step in real for rid, n in step if n > 1]
    assert any(chunks.count(rid) > 1 for rid in chunks)  # and chunked prefill
    assert sim_preemptions == real_preemptions
    assert sim == real
