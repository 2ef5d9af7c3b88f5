"""Host KV tier bookkeeping, exactly: HostBlockPool, KVTier and the cache manager over both pools.

No tensors: the copies a step queues (``TierOps``) are asserted as data.
"""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.hashing import hash_block_tokens
from tandem.engine.host_pool import HostBlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_tier import BlockCopy, KVTier
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    params = SamplingParams(temperature=0.0)
    return Request(rid, tokens, params, eos_token_ids=frozenset(), block_size=BS, max_tokens=16)


def manager(device_blocks: int, host_blocks: int) -> KVCacheManager:
    return KVCacheManager(BlockPool(device_blocks), BS, tier=KVTier(host_blocks))


def compute(kv: KVCacheManager, req: Request) -> None:
    """Admit ``req`` with its device prefix hits and mark its whole prompt computed and cached."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)


# ---- HostBlockPool ------------------------------------------------------------------------------
def test_host_pool_reuses_empty_blocks_before_evicting_cached_ones_lru_first() -> None:
    pool = HostBlockPool(3)
    h = hash_block_tokens(list(range(12)), BS)
    a, b = pool.allocate(2) or []
    pool.register(a, h[0])
    pool.register(b, h[1])
    pool.release([a, b])  # both cached; block 2 never used
    assert pool.usage == pytest.approx(2 / 3)
    (c,) = pool.allocate(1) or []
    assert c.block_id == 2 and pool.lookup(h[0]) is a  # the empty one first
    pool.release([c])  # hash-less: back to the head
    pool.touch(a)  # a is now the most recently used
    assert [x.block_id for x in pool.allocate(2) or []] == [2, 1]
    assert pool.lookup(h[1]) is None and pool.lookup(h[0]) is a
    assert pool.num_evicted == 1
    pool.check_integrity()


def test_host_pool_refuses_what_it_cannot_supply_and_double_release() -> None:
    pool = HostBlockPool(2)
    got = pool.allocate(2) or []
    assert pool.allocate(1) is None and pool.num_free_blocks == 0
    pool.release(got)
    with pytest.raises(RuntimeError):
        pool.release(got[:1])
    with pytest.raises(ValueError):
        HostBlockPool(0)


def test_invalidated_block_is_never_matched_and_reused_first() -> None:
    pool = HostBlockPool(2)
    h = hash_block_tokens(list(range(8)), BS)
    a, b = pool.allocate(2) or []
    pool.register(a, h[0])
    pool.register(b, h[1])
    pool.release([a, b])
    pool.invalidate(b)
    assert pool.lookup(h[1]) is None and pool.num_cached == 1 and pool.usage == 0.5
    pool.check_integrity()
    assert (pool.allocate(1) or [])[0] is b
    pool.check_integrity()


# ---- offload on eviction ----------------------------------------------------------------------
def test_evicted_cached_blocks_are_offloaded_once_and_matched_from_the_host() -> None:
    kv = manager(device_blocks=3, host_blocks=4)
    assert kv.tier is not None
    first = make_request("a", list(range(12)))  # 3 full blocks
    compute(kv, first)
    kv.free(first)
    assert kv.tier.take_ops().is_empty  # nothing evicted yet
    other = make_request("b", list(range(100, 112)))
    compute(kv, other)  # evicts a's three blocks (tail first was freed last: LRU order 2, 1, 0)
    ops = kv.tier.take_ops()
    assert [(c.device_block, c.host_block) for c in ops.offloads] == [(2, 0), (1, 1), (0, 2)]
    assert [c.tag for c in ops.offloads] == first.block_hashes[::-1]
    assert kv.tier.num_offloaded == 3
    # a's prompt again: no device hit, the host tier continues the match (minus the last token).
    again = make_request("a2", list(range(12)) + [99])
    hits, _ = kv.get_computed_blocks(again)
    host = kv.get_host_hits(again, len(hits))
    assert hits == [] and [b.block_id for b in host] == [2, 1, 0]
    kv.check_integrity()


def test_a_block_already_in_the_host_tier_is_not_copied_again() -> None:
    tier = KVTier(2)
    h = hash_block_tokens(list(range(4)), BS)[0]
    tier.on_evict(5, h)
    tier.on_evict(7, h)
    assert tier.take_ops().offloads == [BlockCopy(5, 0, h)]


def test_full_host_tier_of_referenced_blocks_drops_evictions() -> None:
    tier = KVTier(1)
    held = tier.host.allocate(1) or []
    tier.on_evict(3, b"x" * 16)
    assert tier.take_ops().is_empty and tier.host.lookup(b"x" * 16) is None
    tier.host.release(held)


def test_without_prefix_caching_the_tier_neither_offloads_nor_matches() -> None:
    tier = KVTier(4, enable_prefix_caching=False)
    tier.on_evict(0, b"h" * 16)
    assert tier.take_ops().is_empty and tier.match([b"h" * 16]) == []


# ---- loads ------------------------------------------------------------------------------------
def test_load_from_host_allocates_device_blocks_and_queues_exact_copies() -> None:
    kv = manager(device_blocks=2, host_blocks=4)
    assert kv.tier is not None
    base = make_request("a", list(range(8)))
    compute(kv, base)  # device blocks 0, 1
    kv.free(base)  # tail first: the free queue is 1, 0
    filler = make_request("f", list(range(50, 58)))
    compute(kv, filler)  # evicts device 1 (a's block 1) to host 0, device 0 (a's 0) to host 1
    kv.tier.take_ops()
    kv.free(filler)
    req = make_request("b", list(range(8)) + [1, 2, 3])
    hits, _ = kv.get_computed_blocks(req)
    host = kv.get_host_hits(req, len(hits))
    assert hits == [] and [b.block_id for b in host] == [1, 0]
    assert kv.load_from_host(req, hits, host, 0)
    ops = kv.tier.take_ops()
    # Allocation evicted the filler's two cached blocks (offloaded), then loads into them.
    assert [(c.device_block, c.host_block) for c in ops.offloads] == [(0, 2), (1, 3)]
    (load,) = ops.loads
    assert req.block_ids == [0, 1]
    assert [(c.host_block, c.device_block) for c in load.copies] == [(1, 0), (0, 1)]
    assert [c.tag for c in load.copies] == req.block_hashes[:2]
    assert load.num_computed_tokens == 8 and not load.swap
    assert [b.ref_cnt for b in kv.tier.host.blocks] == [1, 1, 0, 0]
    kv.check_integrity()
    done = kv.end_host_load("b", bad_host_blocks=(0,))
    assert done is load
    assert kv.tier.host.lookup(req.block_hashes[1]) is None  # host block 0 held hash 1
    assert kv.tier.host.lookup(req.block_hashes[0]) is not None
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 2 and kv.tier.host.num_free_blocks == 4


def test_load_from_host_changes_nothing_when_the_device_is_full() -> None:
    kv = manager(device_blocks=2, host_blocks=4)
    assert kv.tier is not None
    base = make_request("a", list(range(8)))
    compute(kv, base)
    kv.free(base)
    hog = make_request("hog", list(range(40, 48)))
    compute(kv, hog)  # holds both device blocks; a's blocks are now in the host tier
    kv.tier.take_ops()
    req = make_request("b", list(range(8)) + [5])
    host = kv.get_host_hits(req, 0)
    assert len(host) == 2
    assert not kv.load_from_host(req, [], host, 0)
    assert kv.tier.take_ops().is_empty and req.block_ids == []
    assert all(b.ref_cnt == 0 for b in kv.tier.host.blocks)
    kv.check_integrity()


# ---- swap ---------------------------------------------------------------------------------------
def test_swap_out_keeps_every_computed_block_and_resume_reuses_device_leftovers() -> None:
    kv = manager(device_blocks=8, host_blocks=8)
    assert kv.tier is not None
    req = make_request("r", list(range(10)))  # 2 full blocks + a 2-token tail
    compute(kv, req)
    table = list(req.block_ids)
    assert kv.swap_out(req)
    ops = kv.tier.take_ops()
    assert [(c.device_block, c.host_block) for c in ops.offloads] == list(
        zip(table, [0, 1, 2], strict=True)
    )
    assert [c.tag for c in ops.offloads[:2]] == req.block_hashes
    assert ops.offloads[2].tag.startswith(b"swap:")
    assert req.block_ids == [] and kv.is_swapped(req) and kv.pool.num_free_blocks == 8
    kv.check_integrity()
    # The two full blocks are still cached on the device: only the tail loads back.
    assert kv.resume_swapped(req, 0)
    (load,) = kv.tier.take_ops().loads
    assert req.block_ids[:2] == table[:2]
    assert [(c.host_block, c.device_block) for c in load.copies] == [(2, req.block_ids[2])]
    assert load.swap and load.num_computed_tokens == 10 and not kv.is_swapped(req)
    kv.check_integrity()
    kv.end_host_load("r", ())
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 8 and kv.tier.host.num_free_blocks == 8


def test_swap_out_without_room_changes_nothing() -> None:
    kv = manager(device_blocks=8, host_blocks=2)
    req = make_request("r", list(range(10)))  # needs 3 host blocks
    compute(kv, req)
    table = list(req.block_ids)
    assert not kv.swap_out(req)
    assert req.block_ids == table and not kv.is_swapped(req)
    assert kv.tier is not None and kv.tier.take_ops().is_empty
    kv.check_integrity()


def test_swap_reuses_host_copies_it_already_has_and_free_discards_the_record() -> None:
    kv = manager(device_blocks=8, host_blocks=3)
    assert kv.tier is not None
    req = make_request("r", list(range(9)))
    compute(kv, req)
    kv.tier.on_evict(99, req.block_hashes[0])  # the host tier already holds block 0's hash
    kv.tier.take_ops()
    assert kv.swap_out(req)  # 3 blocks with 3 host blocks: possible only by reusing that copy
    ops = kv.tier.take_ops()
    assert [c.host_block for c in ops.offloads] == [1, 2]
    kv.free(req)  # aborted while swapped out
    kv.check_integrity()
    assert kv.tier.host.num_free_blocks == 3 and kv.tier.num_swapped == 0
    # The hashed copies stay cached for others; the tail was anonymous.
    assert kv.tier.host.num_cached == 2


def test_a_host_load_reserves_room_for_the_tokens_computed_after_it() -> None:
    kv = manager(device_blocks=3, host_blocks=4)
    assert kv.tier is not None
    base = make_request("a", list(range(8)))
    compute(kv, base)
    kv.free(base)
    filler = make_request("f", list(range(50, 62)))
    compute(kv, filler)  # 3 blocks: a's two go to the host tier
    kv.free(filler)
    kv.tier.take_ops()
    req = make_request("b", list(range(8)) + [1, 2, 3])  # 2 host blocks, then 3 tokens
    host = kv.get_host_hits(req, 0)
    assert len(host) == 2
    assert kv.load_from_host(req, [], host, 3)
    assert len(req.block_ids) == 3  # the third is for tokens 8..10, computed after the load
    (load,) = kv.tier.take_ops().loads
    assert [c.device_block for c in load.copies] == req.block_ids[:2]
    assert load.num_computed_tokens == 8
    kv.check_integrity()
