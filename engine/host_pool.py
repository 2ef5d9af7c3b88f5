"""HostBlockPool: the block accounting of the host-memory KV tier (pure; no tensors).

The bytes live in ``TierCopier.host`` (``engine/tier_copier.py``); this pool only says which host
block holds what. A host block is either referenced (``ref_cnt > 0``: a load from the tier reads
it, or a swapped-out request owns it) or in the free queue. A free block may still hold a cached
prefix block (``block_hash`` set): it is evicted, least recently stored or used first, when a
new host block is needed. Blocks without a hash (never used, invalidated, or a swapped request's
partial tail once released) sit at the head of the queue, so they are reused before any cached
block is evicted.

It records a KV event (``tier`` HOST) whenever a hash joins or leaves its map, so the router's
prefix index knows which prefixes a worker can load from host memory (``take_events``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.engine.hashing import BlockHash
from tandem.engine.kv_events import BlockTier, KVEvent, KVEventKind


@dataclass(slots=True, eq=False)
class HostBlock:
    block_id: int
    ref_cnt: int = 0
    # The prefix-cache hash this block's bytes were stored under; None for a swap tail block.
    block_hash: BlockHash | None = None


class HostBlockPool:
    """Owned by the ``KVTier``; called on the engine thread only."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head goes first.
        self._free: OrderedDict[int, HostBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, HostBlock] = {}
        self._num_empty = num_blocks  # free blocks without a hash (kept for O(1) usage)
        self.num_evicted = 0
        self._events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding data (cached or referenced)."""
        return 1.0 - self._num_empty / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> HostBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[HostBlock] | None:
        """Take n blocks off the free queue (evicting cached ones), one reference each, no hash;
        None, changing nothing, when fewer than n are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self.num_evicted += 1
                self._drop_hash(block)
            else:
                self._num_empty -= 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def register(self, block: HostBlock, block_hash: BlockHash) -> None:
        """Name a referenced, hash-less block the host copy of ``block_hash`` (not yet mapped)."""
        if block.ref_cnt < 1 or block.block_hash is not None or block_hash in self._cached:
            raise ValueError(f"host block {block.block_id} cannot be registered")
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._record(KVEventKind.STORED, block_hash)

    def touch(self, block: HostBlock) -> None:
        """A free cached block was used again: it becomes the most recently used."""
        if block.ref_cnt == 0:
            self._free.move_to_end(block.block_id)

    def acquire(self, blocks: list[HostBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                if block.block_hash is None:
                    self._num_empty -= 1
            block.ref_cnt += 1

    def release(self, blocks: list[HostBlock]) -> None:
        """Drop one reference each; a block left unreferenced joins the free queue (the tail if
        it holds a cached block, else the head)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double release of host block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
                    self._num_empty += 1

    def invalidate(self, block: HostBlock) -> None:
        """Forget the block's hash (its bytes failed a check): it is never matched again."""
        if block.block_hash is None:
            return
        self._drop_hash(block)
        if block.ref_cnt == 0:
            self._free.move_to_end(block.block_id, last=False)
            self._num_empty += 1

    def _drop_hash(self, block: HostBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._record(KVEventKind.REMOVED, block.block_hash)
            block.block_hash = None

    def _record(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last.kind is kind:  # one event per run of the same kind
            self._events[-1] = KVEvent(kind, (*last.block_hashes, block_hash), BlockTier.HOST)
        else:
            self._events.append(KVEvent(kind, (block_hash,), BlockTier.HOST))

    def take_events(self) -> list[KVEvent]:
        """Called by the engine after each step, with the device pool's; the caller publishes."""
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free queue, reference counts and hash map disagree."""
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"host block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in self._free
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(
                    f"host block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue {in_free}"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"host block {block.block_id} hash not mapped to itself")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise AssertionError(f"host hash map entry for block {block.block_id} is stale")
        empty = sum(1 for b in self._free.values() if b.block_hash is None)
        if empty != self._num_empty:
            raise AssertionError(f"{empty} empty free host blocks, counted {self._num_empty}")
