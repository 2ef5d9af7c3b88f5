"""TierCopier: moves KV blocks between the device cache and the host tier's memory.

The runner side of the host KV tier (the policy is ``kv_tier.py``). It owns the host tensor
(``[host_blocks, layers, 2, block_size, kv_heads, head_dim]``, pinned on CUDA) and, for each host
block, the tag it was stored under and the checksum of its bytes when stored. A load checks both:
the tag against what the load asked for (a slot reused or mixed up), the checksum of the bytes
that arrived in the device block against the stored one (bytes corrupted anywhere between). A
block failing either check is reported bad; the request then recomputes (never decodes from it).

Ordering. ``submit`` runs each step's offloads, then its loads, on the engine thread right after
scheduling. On CPU every copy is a memcpy done at once. On CUDA they run on a stream of their
own, issued before the step's inputs are prepared so the copies overlap that host work: the
compute stream waits for the step's offloads before its forward pass (which may overwrite the
evicted blocks), and a load is reported only once its event has completed (``poll``), so a
request never runs on a block still being written.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from enum import StrEnum

import torch

from tandem.engine.kv_checksum import block_checksums, cache_checksums
from tandem.engine.kv_tier import BlockCopy, TierOps


class IntegrityFailure(StrEnum):
    """Why a block copy was refused; the ``reason`` label of the integrity metric."""

    TAG = "hash_mismatch"
    CHECKSUM = "checksum_mismatch"


@dataclass(slots=True, frozen=True)
class HostLoadResult:
    """A finished load: the host blocks that failed a check (empty: every block is whole)."""

    request_id: str
    bad_host_blocks: tuple[int, ...]


@dataclass(slots=True)
class _InFlight:
    request_id: str
    host_blocks: list[int]
    ok: torch.Tensor | None  # one bool per checked copy, in host memory once ``event`` is done
    refused: list[int]  # host blocks refused before copying (tag mismatch)
    event: torch.cuda.Event | None


class TierCopier:
    """Owned by the Engine, called on the engine thread only."""

    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        cuda = self.device.type == "cuda"
        self.host = torch.empty(
            (num_host_blocks, *kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=cuda
        )
        self.sums = torch.zeros(num_host_blocks, dtype=torch.int64, device=self.device)
        self.tags: list[bytes | None] = [None] * num_host_blocks
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._offloaded: torch.cuda.Event | None = None
        self._in_flight: list[_InFlight] = []
        self.failures: dict[IntegrityFailure, int] = dict.fromkeys(IntegrityFailure, 0)

    @torch.no_grad()
    def submit(self, ops: TierOps) -> None:
        """Issue one step's copies (``KVTier.take_ops``): offloads, then loads."""
        if ops.is_empty:
            return
        compute = torch.cuda.current_stream(self.device) if self._stream is not None else None
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            if self._stream is not None and compute is not None:
                self._stream.wait_stream(compute)  # the blocks' last writes are done
            if ops.offloads:
                self._offload(ops.offloads)
                if self._stream is not None and compute is not None:
                    self._offloaded = torch.cuda.Event()
                    self._offloaded.record(self._stream)
                    compute.wait_event(self._offloaded)
            for load in ops.loads:
                self._load(load.request_id, load.copies)

    def wait_offloads(self) -> None:
        """Block until this step's offloads are done: call before anything outside the streams
        (a KV connector) writes device blocks the step allocated."""
        if self._offloaded is not None:
            self._offloaded.synchronize()
            self._offloaded = None

    def poll(self) -> list[HostLoadResult]:
        """Loads whose copies are complete, in submission order; each is reported once."""
        done = []
        while self._in_flight:
            load = self._in_flight[0]
            if load.event is not None and not load.event.query():
                break
            self._in_flight.pop(0)
            flags = load.ok.tolist() if load.ok is not None else []
            bad = [h for h, whole in zip(load.host_blocks, flags, strict=True) if not whole]
            self.failures[IntegrityFailure.CHECKSUM] += len(bad)
            done.append(HostLoadResult(load.request_id, tuple(load.refused + bad)))
        return done

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def _offload(self, copies: list[BlockCopy]) -> None:
        src = [c.device_block for c in copies]
        dst = torch.tensor([c.host_block for c in copies])
        if self._stream is None:
            blocks = self.kv_cache[torch.tensor(src)]
            self.sums[dst] = block_checksums(blocks)
            self.host[dst] = blocks
        else:
            self.sums[dst.to(self.device)] = cache_checksums(self.kv_cache, src)
            for c in copies:
                self.host[c.host_block].copy_(self.kv_cache[c.device_block], non_blocking=True)
        for c in copies:
            self.tags[c.host_block] = c.tag

    def _load(self, request_id: str, copies: list[BlockCopy]) -> None:
        refused = [c.host_block for c in copies if self.tags[c.host_block] != c.tag]
        self.failures[IntegrityFailure.TAG] += len(refused)
        good = [c for c in copies if self.tags[c.host_block] == c.tag]
        hosts = [c.host_block for c in good]
        ok = None
        if good:
            dst = [c.device_block for c in good]
            if self._stream is None:
                self.kv_cache[torch.tensor(dst)] = self.host[torch.tensor(hosts)]
            else:
                for c in good:
                    self.kv_cache[c.device_block].copy_(self.host[c.host_block], non_blocking=True)
            expected = self.sums[torch.tensor(hosts, device=self.device)]
            ok = cache_checksums(self.kv_cache, dst) == expected
            if self._stream is not None:  # read by poll() without touching the compute stream
                ok = _to_pinned(ok)
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        self._in_flight.append(_InFlight(request_id, hosts, ok, refused, event))


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
