"""The simulated runner and the engine built around it: real scheduling, profiled time, no
weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import DEMO_TOKENS, synthetic_profile

from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.kv_layout import KVLayout
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim.builder import build_simulated_parts
from tandem.engine.sim.runner import SimulatedRunner
from tandem.engine.sim.tokens import next_token


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _request(rid: str, prompt: list[int], computed: int) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=4), eos_token_ids=frozenset([257]),
                  block_size=16, max_tokens=4)  # fmt: skip
    req.num_computed_tokens = computed
    return req


def test_runner_waits_the_profiled_time_and_emits_the_rule_tokens() -> None:
    profile = synthetic_profile(execute=(0.004, 1e-4, 0.0, 0, 0.0, 0.0, 1e-6))
    layout = KVLayout(4, 2, 32, 16, "float32", 64)
    clock = FakeClock()
    runner = SimulatedRunner(profile.step, layout, DEMO_TOKENS, clock.clock, clock.sleep)
    assert runner.kv_cache.device.type == "meta" and tuple(runner.kv_cache.shape) == layout.shape
    a = _request("a", list(range(1, 41)), 0)  # a 40-token prompt chunk, sampled
    b = _request("b", list(range(50, 70)), 19)  # a decode row: 19 computed, 1 new
    c = _request("c", list(range(100, 164)), 0)  # a chunk that does not reach the end
    out = SchedulerOutput(
        [ScheduledRequest(a, 40, True), ScheduledRequest(b, 1, True),
         ScheduledRequest(c, 32, False)], num_batched_tokens=73,
    )  # fmt: skip
    result = runner.execute(out)
    # execute = 0.004 + 73 tokens x 1e-4 + decode context (19 + 1) x 1e-6
    assert clock.slept == [pytest.approx(0.004 + 73e-4 + 20e-6)]
    assert result.sampled_token_ids == [  # the sampled rows' order: a, b (c is not sampled)
        next_token(a.all_token_ids, DEMO_TOKENS),
        next_token(b.all_token_ids, DEMO_TOKENS),
    ]
    assert result.logprobs == {"a": None, "b": None}
    assert runner.num_steps == 1


def test_a_slow_host_is_not_charged_twice() -> None:
    profile = synthetic_profile(execute=(0.010, 0.0, 0.0, 0, 0.0, 0.0, 0.0))
    clock = FakeClock()

    def slow_clock() -> float:  # 2 ms pass between the runner's two readings
        clock.now += 0.002
        return clock.now

    layout = KVLayout(4, 2, 32, 16, "float32", 8)
    runner = SimulatedRunner(profile.step, layout, DEMO_TOKENS, slow_clock, clock.sleep)
    runner.execute(SchedulerOutput([ScheduledRequest(_request("a", [1, 2], 0), 2, True)]))
    assert clock.slept == [pytest.approx(0.008)]


def test_engine_on_simulated_parts_serves_with_the_real_scheduler() -> None:
    profile = synthetic_profile(execute=(0.0005, 0.0, 0.0, 0, 0.0, 0.0, 0.0), num_blocks=40)
    config = EngineConfig(model="demo")
    parts = build_simulated_parts(config, profile)
    assert parts.layout.num_blocks == 40 and parts.simulated_transfer is profile.transfer
    assert parts.runner.kv_cache.device.type == "meta"
    engine = Engine(parts)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine.add_request("x", "reverse: abc", params)
    engine.add_request("y", [5, 6, 7, 8], params)
    tokens: dict[str, list[int]] = {"x": [], "y": []}
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"x": "length", "y": "length"}
    seq = [5, 6, 7, 8]
    for _ in range(6):
        seq.append(next_token(seq, DEMO_TOKENS))
    assert tokens["y"] == seq[4:]
    engine.check_integrity()
    assert engine.pool.num_free_blocks == 40


def test_a_profile_of_another_model_is_refused() -> None:
    profile = synthetic_profile()
    other = replace(profile, model=replace(profile.model, num_layers=5, head_dim=64))
    with pytest.raises(ValueError, match=r"num_layers \(profile 5, model 4\), head_dim"):
        build_simulated_parts(EngineConfig(model="demo"), other)
