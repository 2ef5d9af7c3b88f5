"""KVCacheManager: per-request block tables over the BlockPool, with prefix caching."""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool, KVCacheBlock
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Called by the Scheduler (engine thread only).

    Ownership: after ``allocate_slots`` the request holds one reference on each of its blocks,
    mirrored in ``request.block_ids``; ``free`` drops them. Prefix hits share a block between
    requests through the reference count. A prefill worker keeps a finished request's blocks here
    (pinned) until the decode worker has pulled them, then calls ``free``.
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

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
        blocks = self._blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so shared prefixes stay cached longest)."""
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        request.block_ids = []

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, []))

    def held_request_ids(self) -> set[str]:
        """Ids of the requests holding a block table (for the engine's accounting checks)."""
        return set(self._blocks)

    def drop_table(self, request_id: str) -> None:
        """Free the blocks of a table whose request the scheduler no longer holds (recovery
        after a failed step, ``engine/recovery.py``)."""
        self.pool.free_blocks(list(reversed(self._blocks.pop(request_id, []))))

    def check_integrity(self) -> None:
        """Pool accounting plus: every held reference belongs to a live request's table."""
        self.pool.check_integrity()
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
