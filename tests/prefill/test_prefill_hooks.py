"""PrefillHooks over a real Scheduler and a fake connector: hand-off, pinning, release."""

from __future__ import annotations

import pytest
from fake_connector import FakeConnector

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import EngineOutput, ModelRunnerOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.prefill.hooks import PrefillHooks, mark_remote_decode

BS = 4
NUM_BLOCKS = 16


def setup() -> tuple[Scheduler, FakeConnector, PrefillHooks]:
    kv = KVCacheManager(BlockPool(NUM_BLOCKS), BS)
    conn = FakeConnector()
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv), conn, PrefillHooks(conn)


def remote_decode_request(rid: str, n: int) -> Request:
    req = Request(
        rid, list(range(100, 100 + n)), SamplingParams(temperature=0, max_tokens=8),
        eos_token_ids=frozenset(), block_size=BS, max_tokens=8,
    )  # fmt: skip
    mark_remote_decode([req])
    return req


def prefill(sched: Scheduler, req: Request, token: int = 42) -> None:
    sched.add_request(req)
    out = sched.schedule()
    assert sched.update(out, ModelRunnerOutput(sampled_token_ids=[token])) == [req]


def test_the_prompt_hands_off_with_its_blocks_pinned_and_published() -> None:
    sched, conn, hooks = setup()
    req = remote_decode_request("r", 10)
    prefill(sched, req)
    assert req.status == RequestStatus.FINISHED_REMOTE_DECODE
    assert sched.pinned == {"r": req} and req.block_ids == [0, 1, 2]
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS - 3

    out = EngineOutput("r", "r", 0, [42], finished=True, finish_reason="remote_decode")
    hooks.on_handoff(req, out)
    assert conn.published == [("r", [0, 1, 2], 10, 42)]
    assert out.kv_transfer_params is not None
    assert out.kv_transfer_params["block_ids"] == [0, 1, 2]
    assert out.kv_transfer_params["num_tokens"] == 10
    assert out.kv_transfer_params["first_token_id"] == 42


def test_released_requests_free_their_pinned_blocks() -> None:
    sched, conn, hooks = setup()
    req = remote_decode_request("r", 10)
    prefill(sched, req)
    assert hooks.before_step(sched) == []
    assert sched.pinned == {"r": req}  # nothing released yet
    conn.release("r")
    assert hooks.before_step(sched) == []
    assert sched.pinned == {} and sched.kv.pool.num_free_blocks == NUM_BLOCKS
    sched.kv.check_integrity()


def test_abort_tells_the_connector_and_frees_the_pinned_blocks() -> None:
    sched, conn, hooks = setup()
    req = remote_decode_request("r", 10)
    prefill(sched, req)
    hooks.on_abort(req)
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert conn.aborted == ["r"]
    assert sched.pinned == {} and sched.kv.pool.num_free_blocks == NUM_BLOCKS


def test_a_prefill_worker_refuses_requests_carrying_kv() -> None:
    _, conn, hooks = setup()
    req = remote_decode_request("r", 4)
    req.kv_transfer_params = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="does not receive KV"):
        hooks.on_admit(req)


def test_requests_without_remote_decode_finish_normally() -> None:
    sched, conn, hooks = setup()
    req = Request(
        "c", list(range(6)), SamplingParams(temperature=0, max_tokens=1),
        eos_token_ids=frozenset(), block_size=BS, max_tokens=1,
    )  # fmt: skip
    prefill(sched, req)
    assert req.status == RequestStatus.FINISHED_LENGTH and sched.pinned == {}
    hooks.on_abort(req)
    assert conn.aborted == [] and conn.published == []
