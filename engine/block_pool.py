"""BlockPool: the fixed set of KV blocks, their reference counts, LRU free queue and hash map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.hashing import BlockHash
from tandem.engine.kv_events import KVEvent, KVEventKind


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the hash map; cleared on eviction.
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class BlockPoolStats:
    num_blocks: int
    num_free: int
    num_cached: int


class BlockPool:
    """Owns every block. Called only from the engine thread (by the KVCacheManager).

    A block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0). A free block may
    still hold a cached prefix (block_hash set); it is evicted, least recently freed first, only
    when a new block is needed. Prefix hits on a free cached block take it back out of the queue.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order is LRU order: the head is evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVEvent] = []
        # Told (block id, hash) just before a cached block is evicted for reuse, while its bytes
        # are still whole: the host KV tier keeps a copy (``KVTier.on_evict``).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks off the free queue (evicting cached ones); the caller owns one ref each."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[KVCacheBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(KVEvent(KVEventKind.REMOVED, tuple(evicted)))
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hits, or a sibling sharing blocks)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (callers pass the tail first,
        so a sequence's last blocks are evicted before its shared prefix)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, in-use block under its hash. A hash already mapped keeps its block;
        this block then stays an uncached duplicate and is freed like any other."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._events.append(KVEvent(KVEventKind.STORED, (block_hash,)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._events.append(KVEvent(KVEventKind.CLEARED))
        return True

    def take_events(self) -> list[KVEvent]:
        """Called by the engine after each step; the caller publishes them."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError if free + used + cached accounting is inconsistent."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free)
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in free_ids
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_free}"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} hash not mapped to itself")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise AssertionError(f"hash map entry for block {block.block_id} is stale")
        if sum(1 for b in self.blocks if b.ref_cnt == 0) != len(self._free):
            raise AssertionError("free queue length differs from blocks with ref_cnt 0")

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached))
