"""A prefill engine (demo model, fake connector) whose hand-off is aborted or fails: pinned
blocks return to the pool only when the connector releases them, never while a transfer may
still read them; a failed hand-off ends its request with an error and frees at once."""

from __future__ import annotations

import pytest
from fake_connector import FakeConnector

from tandem.engine.engine import Engine
from tandem.engine.llm import build_engine_config
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker.protocol import GenerateRequest
from tandem.engine.worker.service import submit
from tandem.prefill.hooks import PrefillHooks
from tandem.prefill.role import PrefillRole

NUM_BLOCKS = 32
PROMPT = [256] + list(range(40, 80))  # 41 tokens: three blocks


def prefill_engine() -> tuple[Engine, FakeConnector]:
    conn = FakeConnector()
    return Engine(build_engine_config("demo", num_blocks=NUM_BLOCKS), PrefillHooks(conn)), conn


def hand_off(engine: Engine, rid: str) -> None:
    greq = GenerateRequest(rid, PROMPT, SamplingParams(temperature=0, max_tokens=8), None,
                           True, 0)  # fmt: skip
    submit(engine, PrefillRole("tcp"), greq)
    while engine.has_unfinished:
        engine.step()
    assert rid in engine.scheduler.pinned


def test_abort_of_a_pinned_request_waits_for_the_connectors_release() -> None:
    engine, conn = prefill_engine()
    hand_off(engine, "r")
    used = NUM_BLOCKS - engine.pool.num_free_blocks
    assert used == 3
    (out,) = engine.abort(["r"])
    assert out.finish_reason == "abort" and conn.aborted == ["r"]
    engine.step()
    # A decode may be reading them: the blocks stay until the connector says they are free.
    assert NUM_BLOCKS - engine.pool.num_free_blocks == used and "r" in engine.scheduler.pinned
    with pytest.raises(ValueError, match="already in use"):
        hand_off(engine, "r")  # nor may a new request take the id meanwhile
    conn.release("r")
    engine.step()
    assert engine.pool.num_free_blocks == NUM_BLOCKS and not engine.scheduler.pinned
    engine.check_integrity()


def test_a_failed_hand_off_ends_with_an_error_and_frees_at_once(monkeypatch) -> None:
    engine, conn = prefill_engine()

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("injected: side channel gone")

    monkeypatch.setattr(conn, "publish", broken)
    greq = GenerateRequest("r", PROMPT, SamplingParams(temperature=0, max_tokens=8), None, True, 0)
    submit(engine, PrefillRole("tcp"), greq)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert outs[-1].finish_reason == "error" and "side channel gone" in (outs[-1].error or "")
    assert outs[-1].kv_transfer_params is None
    assert engine.pool.num_free_blocks == NUM_BLOCKS and not engine.scheduler.pinned
    engine.check_integrity()
