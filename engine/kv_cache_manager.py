"""KVCacheManager: per-request block tables over the BlockPool, with prefix caching, and the
host KV tier (``kv_tier.py``) when one is configured."""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool, KVCacheBlock
from tandem.engine.host_pool import HostBlock
from tandem.engine.kv_tier import HostLoad, KVTier
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Called by the Scheduler (engine thread only).

    Ownership: after ``allocate_slots`` the request holds one reference on each of its blocks,
    mirrored in ``request.block_ids``; ``free`` drops them. Prefix hits share a block between
    requests through the reference count. A prefill worker keeps a finished request's blocks here
    (pinned) until the decode worker has pulled them, then calls ``free``.

    With a ``tier``, blocks the pool evicts are kept in host memory, a prefix match continues
    there (``get_host_hits`` / ``load_from_host``) and preemption can swap (``swap_out`` /
    ``resume_swapped``). A request loading from the tier holds its device blocks here like any
    other; the tier holds the host blocks until ``end_host_load``.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool = True,
        tier: KVTier | None = None,
    ):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = tier
        if tier is not None:
            pool.on_evict = tier.on_evict
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # Per table: its leading blocks known to carry a hash (they keep it while held, since
        # only free blocks are evicted), so cache_blocks() resumes there instead of rescanning.
        self._num_hashed: dict[str, int] = {}
        # Tables whose mark stopped short of their full computed blocks: a duplicate (its hash
        # cached under another block) may become cacheable later. While this is empty, a block
        # can only become cacheable by becoming full, which lets Scheduler.update skip the call.
        self.lagging: set[str] = set()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's full blocks, leaving at least one token to
        compute (its logits are needed). Takes no references: pass the result to allocate_slots."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (not per retry of a request that did not fit)."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` (from get_computed_blocks) are prefix hits for a request that holds no
        blocks yet. Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        computed_blocks = computed_blocks or []
        held = self._blocks.get(request.request_id, [])
        if computed_blocks and held:
            raise ValueError(f"request {request.request_id} already holds blocks")
        base = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        needed = cdiv(base + num_new_tokens, self.block_size) - len(held) - len(computed_blocks)
        # Hits sitting in the free queue stop being allocatable once touched.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(needed, 0))
        blocks = self._blocks.setdefault(request.request_id, held)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        request.block_ids = [b.block_id for b in blocks]
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every full block whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        first = self._num_hashed.get(rid, 0)
        if first >= num_full:
            return  # the common decode step: no block became full
        blocks = self._blocks.get(rid, [])
        hashes = request.block_hashes
        mark = first
        for i in range(first, num_full):
            block = blocks[i]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[i])
            if mark == i and block.block_hash is not None:
                mark += 1  # a duplicate (its hash held by another block) stops the mark
        self._num_hashed[rid] = mark
        if mark < num_full:
            self.lagging.add(rid)
        else:
            self.lagging.discard(rid)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so shared prefixes stay cached longest),
        and its swapped-out copy if it has one."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.lagging.discard(request.request_id)
        self.pool.free_blocks(list(reversed(blocks)))
        request.block_ids = []
        if self.tier is not None:
            self.tier.discard_swap(request.request_id)

    # ---- the host tier ------------------------------------------------------------------------
    def get_host_hits(self, request: Request, num_device_blocks: int) -> list[HostBlock]:
        """Where the device prefix match (``num_device_blocks`` blocks) ends, the host blocks
        that continue it, leaving at least one token to compute. Takes no references."""
        if self.tier is None or not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.tier.match(request.block_hashes[num_device_blocks:max_blocks])

    def load_from_host(
        self,
        request: Request,
        computed_blocks: list[KVCacheBlock],
        host_blocks: list[HostBlock],
        num_next_tokens: int,
    ) -> bool:
        """Admit a request whose prefix is ``computed_blocks`` on the device, then
        ``host_blocks``: allocate device blocks for the host part and queue their load, plus
        room for the ``num_next_tokens`` it computes once loaded (as an admission without the
        tier reserves its first chunk). False, changing nothing, when the pool lacks blocks."""
        assert self.tier is not None
        num_hit = len(computed_blocks) * self.block_size
        num_host = len(host_blocks) * self.block_size
        self.tier.host.acquire(host_blocks)  # before allocating: offloads must not evict them
        if not self.allocate_slots(request, num_host + num_next_tokens, computed_blocks, num_hit):
            self.tier.host.release(host_blocks)
            return False
        first = len(computed_blocks)
        targets = request.block_ids[first : first + len(host_blocks)]
        tags = request.block_hashes[first : first + len(host_blocks)]
        self.tier.start_load(request.request_id, host_blocks, targets, tags, num_hit + num_host)
        return True

    def swap_out(self, request: Request) -> bool:
        """Preemption by swap: copy the request's computed blocks to the host tier and free them
        here. False, changing nothing, without a tier or room in it (the caller recomputes)."""
        computed = request.num_computed_tokens
        blocks = self._blocks.get(request.request_id, [])
        num = cdiv(computed, self.block_size)
        if self.tier is None or num == 0 or num > len(blocks):
            return False
        device_blocks = [b.block_id for b in blocks[:num]]
        hashes = request.block_hashes[: computed // self.block_size]
        if not self.tier.swap_out(request.request_id, device_blocks, hashes, computed):
            return False
        blocks = self._blocks.pop(request.request_id)
        self._num_hashed.pop(request.request_id, None)
        self.lagging.discard(request.request_id)
        self.pool.free_blocks(list(reversed(blocks)))
        request.block_ids = []
        return True

    def is_swapped(self, request: Request) -> bool:
        return self.tier is not None and self.tier.swap_record(request.request_id) is not None

    def resume_swapped(self, request: Request, max_next_tokens: int) -> bool:
        """Admit a swapped-out request: blocks still cached on the device are reused, the rest
        load back from its swap record; room is reserved for the next tokens it computes (at
        most ``max_next_tokens``). False, changing nothing, when the pool lacks blocks."""
        assert self.tier is not None
        record = self.tier.swap_record(request.request_id)
        assert record is not None
        computed = record.num_computed_tokens
        hits, _ = self.get_computed_blocks(request)
        hits = hits[: computed // self.block_size]
        num_hit = len(hits) * self.block_size
        num_next = min(request.num_tokens - computed, max_next_tokens)
        if not self.allocate_slots(request, computed - num_hit + num_next, hits, num_hit):
            return False
        self.tier.take_swap(request.request_id)
        first, num = len(hits), len(record.blocks)
        self.tier.host.release(record.blocks[:first])  # the device still had these
        self.tier.start_load(
            request.request_id, record.blocks[first:], request.block_ids[first:num],
            record.tags[first:], computed, swap=True,
        )  # fmt: skip
        return True

    def end_host_load(self, request_id: str, bad_host_blocks: tuple[int, ...]) -> HostLoad:
        """The copier finished a load (``bad_host_blocks`` failed a check: forgotten)."""
        assert self.tier is not None
        return self.tier.end_load(request_id, bad_host_blocks)

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, []))

    def held_request_ids(self) -> set[str]:
        """Ids of the requests holding a block table (for the engine's accounting checks)."""
        return set(self._blocks)

    def drop_table(self, request_id: str) -> None:
        """Free the blocks of a table whose request the scheduler no longer holds (recovery
        after a failed step, ``engine/recovery.py``)."""
        self._num_hashed.pop(request_id, None)
        self.lagging.discard(request_id)
        self.pool.free_blocks(list(reversed(self._blocks.pop(request_id, []))))

    def check_integrity(self) -> None:
        """Pool accounting plus: every held reference belongs to a live request's table; the
        host tier's accounting likewise."""
        self.pool.check_integrity()
        if self.tier is not None:
            self.tier.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"held by tables {refs.get(block.block_id, 0)}"
                )
