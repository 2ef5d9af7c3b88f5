"""Scheduler policy in isolation: budgets, chunking, priority with aging, preemption order."""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler

BS = 4


def make(rid: str, n: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(temperature=0, max_tokens=50),
        eos_token_ids=frozenset(),
        block_size=BS,
        priority=priority,
        arrival_time=arrival,
        max_tokens=50,
    )


def scheduler(num_blocks: int = 32, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(num_blocks), BS))


def step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    sampled = [7 for x in out.scheduled if x.sample]
    s.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def test_token_budget_chunks_prompts_and_mixes_decodes() -> None:
    s = scheduler(max_num_batched_tokens=6)
    s.add_request(make("a", 3, arrival=0))
    s.add_request(make("b", 10, arrival=1))
    assert step(s) == [("a", 3), ("b", 3)]
    assert step(s) == [("a", 1), ("b", 5)]  # a decodes while b's prefill continues
    assert step(s) == [("a", 1), ("b", 2)]
    assert step(s) == [("a", 1), ("b", 1)]
    s.kv.check_integrity()


def test_max_num_seqs_caps_the_batch() -> None:
    s = scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make(f"r{i}", 2, arrival=i))
    assert [rid for rid, _ in step(s)] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_aging_lets_a_low_priority_request_through() -> None:
    s = scheduler(max_num_seqs=1, aging_steps=2)
    s.add_request(make("low", 2, priority=3, arrival=0))
    s.add_request(make("hog", 2, priority=0, arrival=1))
    order = []
    for i in range(20):
        # A fresh high-priority request arrives every step and would otherwise always win.
        s.add_request(make(f"hi{i}", 1, priority=0, arrival=2 + i))
        if s.running:
            s.finish_requests([s.running[0].request_id], RequestStatus.FINISHED_STOPPED)
        order += [rid for rid, _ in step(s)]
    assert "low" in order


def test_preemption_picks_the_lowest_priority_latest_request() -> None:
    s = scheduler(num_blocks=4)
    s.add_request(make("first", 4, arrival=0))
    s.add_request(make("second", 4, arrival=1))
    s.add_request(make("third", 4, arrival=2))
    step(s)  # 3 blocks in use, then every request needs a second block
    assert sorted(r.request_id for r in s.running) == ["first", "second", "third"]
    step(s)
    assert [r.request_id for r in s.waiting] == ["third"]
    assert s.waiting[0].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    s.kv.check_integrity()


def test_a_duplicate_block_is_cached_once_its_hash_is_free() -> None:
    """Two equal prompts computed in one step: the second's first block duplicates the first's
    (same hash, not cached). Once the first's copy is evicted, the next decode step caches the
    duplicate, though no block of it became full that step."""
    s = scheduler(num_blocks=4)
    a, b = make("a", 6, arrival=0), make("b", 6, arrival=1)
    s.add_request(a)
    s.add_request(b)
    step(s)
    h = b.block_hashes[0]
    assert s.kv.pool.get_cached_block(h).block_id == a.block_ids[0]
    assert s.kv.lagging == {"b"}
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    s.add_request(Request(
        "c", list(range(500, 505)), SamplingParams(temperature=0, max_tokens=50),
        eos_token_ids=frozenset(), block_size=BS, arrival_time=2, max_tokens=50,
    ))  # fmt: skip
    assert step(s) == [("b", 1), ("c", 5)]  # c's blocks are a's, evicting h's copy
    assert s.kv.pool.get_cached_block(h).block_id == b.block_ids[0]
    assert s.kv.lagging == set()
    s.kv.check_integrity()


def test_the_running_order_follows_priority_as_requests_join_and_leave() -> None:
    """schedule() re-sorts ``running`` only when its membership changed since the last sort
    (a running request's key never changes): every step's order is the priority order."""
    s = scheduler(num_blocks=64)
    s.add_request(make("low", 2, priority=5, arrival=0))
    assert [rid for rid, _ in step(s)] == ["low"]
    s.add_request(make("mid", 2, priority=3, arrival=1))
    assert [rid for rid, _ in step(s)] == ["low", "mid"]  # running first, then admissions
    assert [rid for rid, _ in step(s)] == ["mid", "low"]  # running sorted by priority
    s.add_request(make("high", 2, priority=0, arrival=2))
    assert [rid for rid, _ in step(s)] == ["mid", "low", "high"]
    assert [rid for rid, _ in step(s)] == ["high", "mid", "low"]
    assert [rid for rid, _ in step(s)] == ["high", "mid", "low"]  # unchanged, not re-sorted
    s.finish_requests(["mid"], RequestStatus.FINISHED_ABORTED)
    s.add_request(make("top", 2, priority=-1, arrival=3))
    assert [rid for rid, _ in step(s)] == ["high", "low", "top"]
    assert [rid for rid, _ in step(s)] == ["top", "high", "low"]
    s.kv.check_integrity()


def test_num_prompt_tokens_counts_the_prompt_part_of_each_chunk() -> None:
    s = scheduler(max_num_batched_tokens=6)
    s.add_request(make("a", 3, arrival=0))
    s.add_request(make("b", 10, arrival=1))
    counts = []
    for _ in range(4):
        out = s.schedule()
        counts.append(out.num_prompt_tokens)
        sampled = [7 for x in out.scheduled if x.sample]
        s.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    # a: 3, then decodes; b: chunks of 3, 5 and 2, then decodes.
    assert counts == [6, 5, 2, 0]
    # Recomputed after a preemption: the prompt part counts again, the output tokens never.
    (b,) = [r for r in s.running if r.request_id == "b"]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s._preempt(b, SchedulerOutput())
    out = s.schedule()
    ((req, num_new),) = [(x.request, x.num_new_tokens) for x in out.scheduled]
    assert req is b and b.num_computed_tokens < 10 < b.num_computed_tokens + num_new
    assert out.num_prompt_tokens == 10 - b.num_computed_tokens
