"""DecodeHooks over a real Scheduler and a fake connector: the remote-KV path, block by block."""

from __future__ import annotations

import pytest
from fake_connector import FakeConnector, params_for

from tandem.decode.hooks import DecodeHooks, LoadFailurePolicy
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import ModelRunnerOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler

BS = 4
NUM_BLOCKS = 16


def remote_request(rid: str, prompt: list[int], remote_blocks: list[int]) -> Request:
    """As decode's intake leaves it: the prefill's first token is output 0, params attached."""
    req = Request(
        rid,
        prompt,
        SamplingParams(temperature=0, max_tokens=8),
        eos_token_ids=frozenset(),
        block_size=BS,
        max_tokens=8,
    )
    req.append_output_token(5)
    req.kv_transfer_params = params_for(rid, remote_blocks, len(prompt), 5)
    return req


def setup(policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE):
    kv = KVCacheManager(BlockPool(NUM_BLOCKS), BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    conn = FakeConnector()
    return sched, conn, DecodeHooks(conn, policy)


def admit(sched: Scheduler, hooks: DecodeHooks, req: Request) -> None:
    hooks.on_admit(req)
    sched.add_request(req)


def test_admission_holds_the_lease_and_pulls_exactly_the_missing_blocks() -> None:
    sched, conn, hooks = setup()
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    assert conn.held == {"r": req.kv_transfer_params}

    out = sched.schedule()
    assert [(s.remote_block_ids, s.local_block_ids) for s in out.loads] == [([7, 8, 9], [0, 1, 2])]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV and out.scheduled == []
    assert hooks.on_scheduled(sched, out) == []
    assert conn.started == [("r", [7, 8, 9], [0, 1, 2])] and conn.held == {}

    conn.finish("r")
    assert hooks.before_step(sched) == []
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 10
    assert req.block_ids == [0, 1, 2]
    # The next step decodes the prefill's token (position 10) into block 2.
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r", 1)]
    sched.kv.check_integrity()


def test_a_cached_prefix_is_not_pulled_again() -> None:
    sched, conn, hooks = setup()
    first = remote_request("a", list(range(10)), [7, 8, 9])
    admit(sched, hooks, first)
    hooks.on_scheduled(sched, sched.schedule())
    conn.finish("a")
    hooks.before_step(sched)  # blocks 0 and 1 (tokens 0-7) are now cached

    second = remote_request("b", list(range(8)) + [50, 51, 52], [3, 4, 6])
    admit(sched, hooks, second)
    out = sched.schedule()
    assert [(s.remote_block_ids, s.local_block_ids) for s in out.loads] == [([6], [3])]
    assert second.block_ids == [0, 1, 3] and second.num_computed_tokens == 8
    hooks.on_scheduled(sched, out)
    assert conn.started[-1] == ("b", [6], [3])
    sched.kv.check_integrity()


def test_failed_pull_recomputes_the_prompt_locally() -> None:
    sched, conn, hooks = setup(LoadFailurePolicy.RECOMPUTE)
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    hooks.on_scheduled(sched, sched.schedule())
    conn.finish("r", ok=False)
    assert hooks.before_step(sched) == []
    assert req.status == RequestStatus.WAITING and req.kv_transfer_params is None
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS
    out = sched.schedule()  # now a local prefill of prompt + the prefill's token
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r", 11)]
    assert out.loads == []


def test_failed_pull_under_policy_fail_ends_the_request_and_frees_its_blocks() -> None:
    sched, conn, hooks = setup(LoadFailurePolicy.FAIL)
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    hooks.on_scheduled(sched, sched.schedule())
    conn.finish("r", ok=False)
    assert hooks.before_step(sched) == [req]
    assert req.status == RequestStatus.FINISHED_ERROR
    assert req.error == (
        "KV transfer from the prefill worker failed: peer_disconnected: prefill went away"
    )
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS
    sched.kv.check_integrity()


def test_a_pull_the_connector_refuses_fails_at_once() -> None:
    sched, conn, hooks = setup(LoadFailurePolicy.FAIL)
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    out = sched.schedule()
    out.loads[0].remote_block_ids = [99]  # not among the published blocks
    assert hooks.on_scheduled(sched, out) == [req]
    assert req.error is not None and "invalid transfer" in req.error
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS


def test_abort_while_loading_waits_for_the_pull_before_freeing() -> None:
    sched, conn, hooks = setup()
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    hooks.on_scheduled(sched, sched.schedule())
    hooks.on_abort(req)
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert conn.aborted == ["r"]
    assert sched.kv.num_blocks_held("r") == 3  # the connector may still write them
    conn.finish("r", ok=False)
    assert hooks.before_step(sched) == [req]
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS
    sched.kv.check_integrity()


def test_a_second_hold_of_the_same_id_is_refused_before_queueing() -> None:
    sched, conn, hooks = setup()
    admit(sched, hooks, remote_request("r", list(range(10)), [7, 8, 9]))
    with pytest.raises(ValueError, match="already held"):
        hooks.on_admit(remote_request("r", list(range(10)), [7, 8, 9]))
    assert len(sched.waiting) == 1


def test_local_requests_pass_through_untouched() -> None:
    sched, conn, hooks = setup()
    req = Request(
        "l", list(range(6)), SamplingParams(temperature=0, max_tokens=2),
        eos_token_ids=frozenset(), block_size=BS, max_tokens=2,
    )  # fmt: skip
    admit(sched, hooks, req)
    out = sched.schedule()
    assert out.loads == [] and hooks.on_scheduled(sched, out) == []
    sched.update(out, ModelRunnerOutput(sampled_token_ids=[3]))
    hooks.on_abort(req)
    assert conn.held == {} and conn.started == [] and conn.aborted == []


def test_a_preempted_request_recomputes_locally_instead_of_pulling_again() -> None:
    sched, conn, hooks = setup()
    req = remote_request("r", list(range(10)), [7, 8, 9])
    admit(sched, hooks, req)
    hooks.on_scheduled(sched, sched.schedule())
    conn.finish("r")
    hooks.before_step(sched)
    assert req.status == RequestStatus.RUNNING and req.kv_transfer_params is None
    out = sched.schedule()
    sched._preempt(req, out)  # the prefill has released its blocks by now
    assert req.status == RequestStatus.PREEMPTED
    again = sched.schedule()
    assert again.loads == [] and len(conn.started) == 1
    # Local recompute of what the prefix cache lacks: tokens 8-10 (blocks 0-1 are cached).
    assert [(s.request.request_id, s.num_new_tokens) for s in again.scheduled] == [("r", 3)]
    assert req.num_computed_tokens == 8
    hooks.on_abort(req)
    assert conn.aborted == []  # nothing of the prefill's is held any more
