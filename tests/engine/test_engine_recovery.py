"""Failure containment inside Engine.step (engine/recovery.py), on the demo model in process: a
failed phase fails exactly the requests it is attributed to, the others continue untouched, the
accounting holds, and an engine whose state cannot be restored raises EngineFailed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tandem.engine.engine as engine_module
from tandem.engine.engine import MAX_CONSECUTIVE_FAILED_STEPS, Engine, EngineFailed
from tandem.engine.llm import build_engine_config
from tandem.engine.outputs import EngineOutput
from tandem.engine.sampling_params import SamplingParams

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(build_engine_config("demo", num_blocks=NUM_BLOCKS))


@pytest.fixture(autouse=True)
def idle_after(engine: Engine) -> Iterator[None]:
    yield
    engine.abort([r.request_id for r in engine.all_requests()])
    engine.step()  # a step that succeeds ends any run of failed steps
    while engine.has_unfinished or engine.scheduler.pinned:
        engine.step()
    engine.check_integrity()
    assert engine.pool.num_free_blocks == NUM_BLOCKS and engine.accounting().idle


def params(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine: Engine, on_step=None) -> dict[str, list[EngineOutput]]:  # noqa: ANN001
    outs: dict[str, list[EngineOutput]] = {}
    steps = 0
    while engine.has_unfinished:
        if on_step is not None:
            on_step(steps)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
    return outs


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def reference(engine: Engine, prompt: list[int], n: int = 12) -> list[int]:
    engine.add_request("ref", prompt, params(n))
    return tokens(run(engine)["ref"])


def test_a_failed_model_run_fails_its_batch_and_the_rest_continue(monkeypatch) -> None:
    engine = Engine(build_engine_config("demo", num_blocks=NUM_BLOCKS, max_num_seqs=1))
    a, b = [256, 5, 6, 7], [256, 8, 9, 10, 11]
    expected_b = reference(engine, b)
    engine.add_request("a", a, params())
    engine.add_request("b", b, params())  # waits: one sequence at a time
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(out):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outs = run(engine)
    assert outs["a"][-1].finish_reason == "error"
    assert "injected forward failure" in (outs["a"][-1].error or "")
    assert len(tokens(outs["a"])) == 2  # two steps ran before the failure
    assert tokens(outs["b"]) == expected_b and outs["b"][-1].finish_reason == "length"
    engine.check_integrity()
    assert engine.pool.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("a_ends", [True, False], ids=["failing-one-ends", "another-ends"])
def test_an_output_failure_fails_that_request_alone(
    engine: Engine, monkeypatch, a_ends: bool
) -> None:
    """The engine thread builds outputs in a step where a request ends (a step where all go on
    returns a StepOutputs, made by its reader from fields fixed while a request runs): a
    failure there is found request by request, whether the failing request ended in that step
    (its blocks already free) or goes on beside one that ended."""
    a, b = [256, 5, 6, 7], [256, 8, 9, 10, 11]
    expected_b = reference(engine, b)
    real = engine_module.request_outputs

    def bad(reqs, logprobs, new_token=True):  # noqa: ANN001, ANN202
        if new_token and any(r.request_id == "a" and r.num_output_tokens == 3 for r in reqs):
            raise ValueError("injected output failure")
        return real(reqs, logprobs, new_token)

    monkeypatch.setattr(engine_module, "request_outputs", bad)
    # The step of a's third token builds outputs: a ends there, or c does.
    engine.add_request("a", a, params(3 if a_ends else 12))
    engine.add_request("b", b, params())
    if not a_ends:
        engine.add_request("c", [256, 1, 2], params(3))
    outs = run(engine)
    if not a_ends:
        assert outs["c"][-1].finish_reason == "length" and len(tokens(outs["c"])) == 3
    assert outs["a"][-1].finish_reason == "error" and len(tokens(outs["a"])) == 2
    # The request batched with it lost no token.
    assert tokens(outs["b"]) == expected_b


def test_a_failed_hand_off_fails_that_request_alone(engine: Engine, monkeypatch) -> None:
    """A request that ends in a step whose outputs are built together (here a prefill hand-off
    whose publication fails) is contained alone: its batch-mates keep every token."""
    b = [256, 8, 9, 10, 11]
    expected_b = reference(engine, b)

    def bad(req, out):  # noqa: ANN001, ANN202
        raise ValueError("injected hand-off failure")

    monkeypatch.setattr(engine.hooks, "on_admit", lambda req: None)  # a prefill worker's
    monkeypatch.setattr(engine.hooks, "on_handoff", bad)
    (a,) = engine.make_requests("a", [256, 5, 6, 7], params())
    a.remote_decode = True
    engine.enqueue(a)
    engine.add_request("b", b, params())
    outs = run(engine)
    assert [o.finish_reason for o in outs["a"]] == ["error"]
    assert "injected hand-off failure" in (outs["a"][-1].error or "")
    assert tokens(outs["b"]) == expected_b and outs["b"][-1].finish_reason == "length"
    assert not engine.scheduler.pinned


def test_corrupt_state_is_reset_and_the_engine_serves_again(engine: Engine, monkeypatch) -> None:
    engine.add_request("a", [256, 5, 6, 7], params())
    engine.add_request("b", [256, 8, 9], params())
    engine.step()
    real = engine.scheduler.schedule
    phantom = engine.make_requests("phantom", [256, 1, 2, 3, 4, 5], params())[0]

    def corrupting():  # noqa: ANN202
        # Blocks taken for a request no queue holds, then a crash: an orphaned table.
        engine.kv.allocate_slots(phantom, 6)
        raise RuntimeError("injected scheduling failure")

    monkeypatch.setattr(engine.scheduler, "schedule", corrupting)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert {o.finish_reason for o in outs} == {"error"}
    engine.check_integrity()
    assert engine.pool.num_free_blocks == NUM_BLOCKS
    monkeypatch.setattr(engine.scheduler, "schedule", real)
    engine.add_request("c", [256, 5, 6, 7], params(4))
    assert run(engine)["c"][-1].finish_reason == "length"


def test_unrestorable_state_raises_engine_failed(engine: Engine, monkeypatch) -> None:
    engine.add_request("a", [256, 5, 6, 7], params())

    def broken() -> None:
        raise AssertionError("injected: accounting never holds")

    monkeypatch.setattr(engine.runner, "execute", lambda out: 1 / 0)
    monkeypatch.setattr("tandem.engine.recovery.check_engine_integrity", lambda e: broken())
    with pytest.raises(EngineFailed, match="cannot be restored"):
        engine.step()


def test_a_failure_repeating_every_step_is_the_engines(engine: Engine, monkeypatch) -> None:
    monkeypatch.setattr(engine.runner, "execute", lambda out: 1 / 0)
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request(f"r{i}", [256, 5, 6, 7], params())
        (out,) = engine.step()
        assert out.finish_reason == "error"
    engine.add_request("last", [256, 5, 6, 7], params())
    with pytest.raises(EngineFailed, match="in a row"):
        engine.step()


def test_duplicate_ids_are_refused_while_the_request_may_hold_blocks(engine: Engine) -> None:
    engine.add_request("dup", [256, 5, 6, 7], params())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [256, 5], params())
    engine.add_request("grp", [256, 5, 6, 7], SamplingParams(n=2, max_tokens=4))
    for rid in ("grp", "grp-1"):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(rid, [256, 5], params())
