"""TierCopier and the block checksum: exact bytes both ways, and every corruption is refused."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kv_checksum import block_checksums
from tandem.engine.kv_tier import BlockCopy, HostLoad, TierOps
from tandem.engine.tier_copier import IntegrityFailure, TierCopier

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, kv heads, head dim


def cache(num_blocks: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *SHAPE), generator=g).to(dtype)


def load(rid: str, pairs: list[tuple[int, int]], tags: list[bytes]) -> HostLoad:
    copies = [BlockCopy(d, h, t) for (h, d), t in zip(pairs, tags, strict=True)]
    return HostLoad(rid, copies, [], num_computed_tokens=0, swap=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksum_is_exact_and_sees_flips_swaps_and_stale_blocks(dtype: torch.dtype) -> None:
    kv = cache(4, dtype)
    sums = block_checksums(kv)
    assert sums.dtype == torch.int64 and sums.shape == (4,)
    assert torch.equal(block_checksums(kv.clone()), sums)  # deterministic
    assert torch.equal(block_checksums(kv[[2, 0]]), sums[[2, 0]])  # per block, any batch
    flipped = kv.clone()
    flipped.view(torch.int16 if kv.element_size() == 2 else torch.int32)[1, 0, 0, 3, 1, 5] ^= 1
    assert (block_checksums(flipped) != sums).tolist() == [False, True, False, False]
    swapped = kv.clone()
    a, b = swapped[3, 0, 0, 0, 0, 0].clone(), swapped[3, 1, 1, 2, 1, 7].clone()
    swapped[3, 0, 0, 0, 0, 0], swapped[3, 1, 1, 2, 1, 7] = b, a  # two values trade places
    assert block_checksums(swapped)[3] != sums[3]
    assert block_checksums(torch.zeros_like(kv[:1]))[0] == 0  # a block never written


def test_checksum_of_one_byte_dtypes() -> None:
    kv = cache(2).to(torch.float8_e4m3fn)
    sums = block_checksums(kv)
    bumped = kv.clone()
    bumped.view(torch.uint8)[0, 1, 1, 1, 1, 1] ^= 0x10
    assert block_checksums(bumped)[0] != sums[0] and block_checksums(bumped)[1] == sums[1]


def test_offload_then_load_round_trips_the_exact_bytes() -> None:
    kv = cache(6)
    original = kv.clone()
    copier = TierCopier(kv, num_host_blocks=4)
    copier.submit(TierOps(offloads=[BlockCopy(1, 3, b"h1"), BlockCopy(4, 0, b"h4")]))
    assert torch.equal(copier.host[3], original[1]) and torch.equal(copier.host[0], original[4])
    assert copier.tags[3] == b"h1" and copier.tags[0] == b"h4"
    kv[2].zero_()
    kv[5].zero_()
    copier.submit(TierOps(loads=[load("r", [(3, 2), (0, 5)], [b"h1", b"h4"])]))
    assert torch.equal(kv[2], original[1]) and torch.equal(kv[5], original[4])
    (res,) = copier.poll()
    assert res.request_id == "r" and res.bad_host_blocks == ()
    assert copier.poll() == []  # reported once


def test_offloads_run_before_loads_that_reuse_their_blocks() -> None:
    kv = cache(2)
    original = kv.clone()
    copier = TierCopier(kv, num_host_blocks=2)
    copier.submit(TierOps(offloads=[BlockCopy(0, 0, b"a")]))
    # One step: block 1 is evicted (offloaded) and reused as the target of a load of host 0.
    copier.submit(TierOps([BlockCopy(1, 1, b"b")], [load("r", [(0, 1)], [b"a"])]))
    assert torch.equal(copier.host[1], original[1]) and torch.equal(kv[1], original[0])
    assert [r.bad_host_blocks for r in copier.poll()] == [()]


def test_corrupted_host_bytes_fail_the_checksum_and_are_reported() -> None:
    kv = cache(4)
    copier = TierCopier(kv, num_host_blocks=4)
    copier.submit(TierOps(offloads=[BlockCopy(0, 0, b"a"), BlockCopy(1, 1, b"b")]))
    copier.host[1, 0, 1, 2, 0, 3] += 1.0  # host memory goes bad after the store
    copier.submit(TierOps(loads=[load("r", [(0, 2), (1, 3)], [b"a", b"b"])]))
    (res,) = copier.poll()
    assert res.bad_host_blocks == (1,)
    assert copier.failures[IntegrityFailure.CHECKSUM] == 1


def test_a_host_block_holding_something_else_is_refused_without_copying() -> None:
    kv = cache(4)
    copier = TierCopier(kv, num_host_blocks=2)
    copier.submit(TierOps(offloads=[BlockCopy(0, 0, b"a")]))
    before = kv[3].clone()
    copier.submit(TierOps(loads=[load("r", [(0, 3)], [b"not-a"])]))
    (res,) = copier.poll()
    assert res.bad_host_blocks == (0,) and torch.equal(kv[3], before)
    assert copier.failures[IntegrityFailure.TAG] == 1


def test_checksum_is_the_exact_integer_weighted_sum_across_segments() -> None:
    from tandem.engine.kv_checksum import _weight

    g = torch.Generator().manual_seed(1)
    # Past one float64 segment (2**20 elements), with extreme values: still exact.
    x = torch.randint(-32768, 32768, (2, (1 << 20) + 5), dtype=torch.int16, generator=g)
    x[0, :1000] = -32768
    w = _weight(x.shape[1], x.device).to(torch.int64)
    assert torch.equal(block_checksums(x.view(torch.float16)), (x.to(torch.int64) * w).sum(1))
