"""EngineThread's hand-over of outputs: with ``post`` each step's outputs cross in one call and
the sinks run where it runs them; without it the sinks run on the engine thread. A dying thread
ends every stream in one hand-over too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tandem.engine.engine import Engine, EngineFailed
from tandem.engine.llm import build_engine_config
from tandem.engine.outputs import EngineOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker.engine_thread import EngineThread

PROMPTS = {"a": [256, 5, 6, 7], "b": [256, 8, 9], "c": [256, 1, 2, 3, 4]}


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_each_step_hands_its_outputs_over_in_one_post() -> None:
    engine = Engine(build_engine_config("demo", num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished:
        for o in engine.step():
            expected[o.request_id] += o.new_token_ids

    posts: list[tuple[Callable[[list[EngineOutput]], None], list[EngineOutput]]] = []
    lock = threading.Lock()

    def post(fn: Callable[[list[EngineOutput]], None], outputs: list[EngineOutput]) -> None:
        with lock:
            posts.append((fn, outputs))

    thread = EngineThread(engine, post=post)
    got: dict[str, list[EngineOutput]] = {rid: [] for rid in PROMPTS}
    for rid in PROMPTS:
        thread.subscribe(rid, got[rid].append)
    thread.start()
    try:
        thread.call(lambda e: [e.add_request(r, p, params) for r, p in PROMPTS.items()]).result()
        wait_for(lambda: not thread.busy() and bool(posts))
    finally:
        thread.stop()
    assert all(not got[rid] for rid in PROMPTS)  # nothing ran on the engine thread
    assert len(posts) == 6  # one per step: the prompts together, then 5 decodes
    for fn, outputs in posts:
        assert len({o.request_id for o in outputs}) == len(outputs)  # a step's whole batch
        fn(outputs)
    for rid in PROMPTS:
        assert [t for o in got[rid] for t in o.new_token_ids] == expected[rid]
        assert [o.finished for o in got[rid]] == [False] * 5 + [True]


def test_a_dying_thread_ends_every_stream_in_one_hand_over() -> None:
    engine = Engine(build_engine_config("demo", num_blocks=64))
    posts: list[list[EngineOutput]] = []

    def broken() -> list[EngineOutput]:
        raise EngineFailed("injected")

    engine.step = broken  # type: ignore[method-assign]
    thread = EngineThread(engine, post=lambda fn, outputs: posts.append(outputs))
    for rid in ("x", "y"):
        thread.subscribe(rid, lambda o: None)
    thread.start()
    wait_for(lambda: not thread.alive)
    ((x, y),) = posts
    assert (x.group_id, y.group_id) == ("x", "y")
    assert all(o.finished and o.index == -1 and o.finish_reason == "error" for o in (x, y))


def test_busy_seconds_count_the_steps_that_ran_the_model(monkeypatch) -> None:
    import types

    import tandem.engine.engine as engine_module

    ticks = iter(range(1000))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)), monotonic=time.monotonic)
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine(build_engine_config("demo", num_blocks=64))
    assert engine.step() == [] and engine.busy_seconds == 0.0  # idle: nothing ran
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", PROMPTS["a"], params)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    # Each step reads the clock at its start and after the update: one tick apart.
    assert steps == 3 and engine.busy_seconds == 3.0


def test_wake_ends_the_wait_for_commands_at_once() -> None:
    """An idle engine thread waits ``idle_wait_s`` for a command; ``wake`` (what the KV
    connector calls when a load ends or blocks are released) makes it step again now, and
    ``stop`` wakes it too."""
    engine = Engine(build_engine_config("demo", num_blocks=64))
    steps: list[float] = []
    step = engine.step

    def counted() -> list[EngineOutput]:
        steps.append(time.monotonic())
        return step()

    engine.step = counted  # type: ignore[method-assign]
    thread = EngineThread(engine, idle_wait_s=60.0)
    thread.start()
    try:
        thread.call(lambda e: None).result(timeout=20.0)
        wait_for(lambda: len(steps) == 1)  # stepped once, now waiting up to 60 s
        woken = time.monotonic()
        thread.wake()
        wait_for(lambda: len(steps) == 2, timeout=20.0)  # far under the 60 s wait
        assert steps[1] >= woken and thread.alive and not thread.busy()
    finally:
        thread.stop(timeout=20.0)
    assert not thread.alive and len(steps) == 3  # stop's wake: one last step, then it ends
