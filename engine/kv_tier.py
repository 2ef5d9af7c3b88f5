"""KVTier: the host-memory KV tier's policy (pure bookkeeping; ``TierCopier`` does the copies).

Three flows, all on the engine thread:

- **offload**: the device pool evicts a cached block; ``on_evict`` keeps it here (a device->host
  copy is queued). When every host block is referenced, the block is dropped as without a tier.
- **load**: admission continues a prefix match into the host tier (``match``); the cache manager
  holds those host blocks, allocates device blocks and ``start_load`` queues host->device copies.
  The request waits in ``Scheduler.loading`` until the copier reports the load (``end_load``).
- **swap**: a preempted request's computed blocks, partial tail included, are copied here
  (``swap_out``) and owned by its ``SwapRecord`` until it resumes (a load) or ends.

Each copy names the tag its host block is stored under (the block hash, or a one-off swap tag),
so the copier can refuse a host block that no longer holds what was asked for. The engine takes
the step's ``TierOps`` once, right after scheduling, and the copier runs them before anything else
writes a freshly allocated block: offloads first (they read blocks the same step may reuse),
then loads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tandem.engine.hashing import BlockHash
from tandem.engine.host_pool import HostBlock, HostBlockPool


@dataclass(slots=True, frozen=True)
class BlockCopy:
    device_block: int
    host_block: int
    tag: bytes


@dataclass(slots=True)
class HostLoad:
    """One request's load from the host tier; holds a reference on each host block it reads."""

    request_id: str
    copies: list[BlockCopy]
    blocks: list[HostBlock]
    # The request's computed tokens once every copy is whole.
    num_computed_tokens: int
    # A swapped-out request resuming (not a prefix-cache hit).
    swap: bool


@dataclass(slots=True)
class SwapRecord:
    """A swapped-out request's KV: host block i holds the request's logical block i."""

    blocks: list[HostBlock]
    tags: list[bytes]
    num_computed_tokens: int


@dataclass(slots=True)
class TierOps:
    """The copies one step queued, in order; run by ``TierCopier.submit``."""

    offloads: list[BlockCopy] = field(default_factory=list)
    loads: list[HostLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.offloads and not self.loads


class KVTier:
    """Owned by the ``KVCacheManager``. Without prefix caching it only swaps (nothing is matched
    or offloaded by hash, so no request ever reads another's blocks)."""

    def __init__(self, num_host_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.host = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._ops = TierOps()
        self._loads: dict[str, HostLoad] = {}
        self._swapped: dict[str, SwapRecord] = {}
        self._swap_seq = 0
        self.num_offloaded = 0  # device -> host block copies queued
        self.num_loaded = 0  # host -> device block copies queued

    # ---- offload ------------------------------------------------------------------------------
    def on_evict(self, device_block: int, block_hash: BlockHash) -> None:
        """The device pool is about to reuse a cached block (``BlockPool.on_evict``)."""
        if not self.enable_prefix_caching:
            return
        held = self.host.lookup(block_hash)
        if held is not None:
            self.host.touch(held)
            return
        got = self.host.allocate(1)
        if got is None:
            return
        self.host.register(got[0], block_hash)
        self._queue_offload(device_block, got[0], block_hash)
        self.host.release(got)  # cached, unreferenced, most recently used

    def _queue_offload(self, device_block: int, block: HostBlock, tag: bytes) -> None:
        self._ops.offloads.append(BlockCopy(device_block, block.block_id, tag))
        self.num_offloaded += 1

    # ---- load ---------------------------------------------------------------------------------
    def match(self, block_hashes: list[BlockHash]) -> list[HostBlock]:
        """The host blocks of the longest leading run of ``block_hashes`` held here (no refs)."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for h in block_hashes:
            block = self.host.lookup(h)
            if block is None:
                break
            out.append(block)
        return out

    def start_load(
        self,
        request_id: str,
        blocks: list[HostBlock],
        device_blocks: list[int],
        tags: list[bytes],
        num_computed_tokens: int,
        swap: bool = False,
    ) -> None:
        """Queue ``blocks[i]`` -> ``device_blocks[i]``; the caller already holds one reference
        on each host block, which the load now owns until ``end_load``."""
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} is already loading from the host tier")
        copies = [
            BlockCopy(d, b.block_id, t) for d, b, t in zip(device_blocks, blocks, tags, strict=True)
        ]
        load = HostLoad(request_id, copies, list(blocks), num_computed_tokens, swap)
        self._loads[request_id] = load
        self._ops.loads.append(load)
        self.num_loaded += len(copies)

    def end_load(self, request_id: str, bad_host_blocks: tuple[int, ...]) -> HostLoad:
        """The copier finished the load; host blocks that failed a check are forgotten."""
        load = self._loads.pop(request_id)
        bad = set(bad_host_blocks)
        for block in load.blocks:
            if block.block_id in bad:
                self.host.invalidate(block)
        self.host.release(load.blocks)
        return load

    # ---- swap ---------------------------------------------------------------------------------
    def swap_out(
        self,
        request_id: str,
        device_blocks: list[int],
        block_hashes: list[BlockHash],
        num_computed_tokens: int,
    ) -> bool:
        """Keep ``device_blocks`` (the request's computed blocks; the first ``len(block_hashes)``
        are full) here. False, changing nothing, when the tier lacks room."""
        hashes = block_hashes if self.enable_prefix_caching else []
        present = [self.host.lookup(h) for h in hashes]
        held = [b for b in present if b is not None]
        self.host.acquire(held)  # before allocating, so no eviction takes them
        new = self.host.allocate(len(device_blocks) - len(held))
        if new is None:
            self.host.release(held)
            return False
        fresh = iter(new)
        self._swap_seq += 1
        blocks: list[HostBlock] = []
        tags: list[bytes] = []
        for i, device_block in enumerate(device_blocks):
            block = present[i] if i < len(present) else None
            if block is not None:
                tag = hashes[i]
            else:
                block = next(fresh)
                if i < len(hashes):
                    tag = hashes[i]
                    self.host.register(block, tag)
                else:
                    tag = f"swap:{self._swap_seq}:{request_id}:{i}".encode()
                self._queue_offload(device_block, block, tag)
            blocks.append(block)
            tags.append(tag)
        self._swapped[request_id] = SwapRecord(blocks, tags, num_computed_tokens)
        return True

    def swap_record(self, request_id: str) -> SwapRecord | None:
        return self._swapped.get(request_id)

    def take_swap(self, request_id: str) -> SwapRecord:
        """The request resumes: its record (and references) pass to the caller."""
        return self._swapped.pop(request_id)

    def discard_swap(self, request_id: str) -> None:
        """The request ended while swapped out: release its host blocks."""
        record = self._swapped.pop(request_id, None)
        if record is not None:
            self.host.release(record.blocks)

    # ---- the step -----------------------------------------------------------------------------
    def take_ops(self) -> TierOps:
        """Called by the engine once per step, after scheduling."""
        ops, self._ops = self._ops, TierOps()
        return ops

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def loading_ids(self) -> set[str]:
        return set(self._loads)

    def check_integrity(self) -> None:
        """Host pool accounting plus: every host reference belongs to a load or a swap record."""
        self.host.check_integrity()
        refs: Counter[int] = Counter()
        for owner in (*self._loads.values(), *self._swapped.values()):
            refs.update(b.block_id for b in owner.blocks)
        for block in self.host.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"host block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"held by loads and swaps {refs[block.block_id]}"
                )
