"""BlockPool and KVCacheManager: exact block ids, LRU eviction, prefix hits, accounting."""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool, KVEventKind
from tandem.engine.hashing import hash_block, hash_block_tokens
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(temperature=0.0),
        eos_token_ids=frozenset(),
        block_size=BS,
        max_tokens=16,
    )


def test_hash_is_chained_stable_and_skips_partial_blocks() -> None:
    hashes = hash_block_tokens(list(range(10)), BS)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Same tokens under a different parent hash differently.
    assert hash_block(None, [4, 5, 6, 7]) != hashes[1]
    # Pinned value: H must not change across processes, machines or releases (the router and
    # every worker compute it independently).
    assert hash_block(None, [1, 2, 3]).hex() == "a73229ba37cecda3c76c2edbbaf17cda"
    assert len(hashes[0]) == 16


def test_new_blocks_come_out_in_lru_order_and_free_goes_to_tail() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.free_blocks([a[1], a[0]])
    # Free queue is now 2, 3, 1, 0.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 3, 1, 0]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_integrity()


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


def test_cached_free_block_is_evicted_last_recently_freed_first_with_events() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 16)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    events = pool.take_events()
    assert [e.kind for e in events] == [KVEventKind.STORED] * 3
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 2 and new.block_hash is None
    assert pool.get_cached_block(bytes([2]) * 16) is None
    assert pool.get_cached_block(bytes([0]) * 16) is blocks[0]
    (removed,) = pool.take_events()
    assert removed.kind == KVEventKind.REMOVED and removed.block_hashes == (bytes([2]) * 16,)
    pool.check_integrity()


def test_manager_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1 token
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 9)
    assert a.block_ids == [0, 1, 2]
    kv.cache_blocks(a, 9)

    b = make_request("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 2, hits, n)
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    # A prompt that is exactly the cached blocks still computes its last token.
    c = make_request("c", list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4
    kv.check_integrity()

    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 10
    assert kv.hit_tokens == 0  # lookups alone count nothing; the scheduler records admissions


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(BlockPool(3), BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.free(a)
    # Both cached blocks sit in the free queue; a hit on them plus 2 new blocks needs 4 > 3.
    b = make_request("b", list(range(8)) + list(range(100, 108)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, 8, hits, n)
    assert b.block_ids == [] and kv.pool.num_free_blocks == 3
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    kv.check_integrity()
