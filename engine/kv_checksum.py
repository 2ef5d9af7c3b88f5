"""The cheap checksum every KV block copy is checked against (host tier and peer pulls).

A position-weighted sum of the block's bytes read as 16-bit integers (8-bit for 1-byte dtypes):
it catches a flipped bit, a zeroed or stale block and blocks swapped with each other, costs one
pass over the bytes, and is computed on the tensor's own device. Integer arithmetic without
overflow (|x| < 2**15, weights < 2**16, sums in int64), so the value is exact whatever the
reduction order: the same bytes give the same checksum on CPU and GPU, in any process.
"""

from __future__ import annotations

import torch

_MODULUS = 65521  # prime, so weights repeat only every 65521 positions
_STRIDE = 40503
# Blocks are gathered and summed at most this many bytes at a time (bounded temporaries).
_CHUNK_BYTES = 32 << 20
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weight(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    w = _weights.get(key)
    if w is None:
        idx = torch.arange(n, dtype=torch.int64, device=device)
        w = ((idx * _STRIDE) % _MODULUS + 1).to(torch.int32)
        _weights[key] = w
    return w


def _blocks_per_chunk(block: torch.Tensor) -> int:
    return max(1, _CHUNK_BYTES // max(1, block.numel() * 4))


def block_checksums(blocks: torch.Tensor) -> torch.Tensor:
    """One int64 checksum per block of ``blocks`` (shape [n, ...], any KV dtype), on its device."""
    n = blocks.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=blocks.device)
    flat = blocks.contiguous().reshape(n, -1)
    ints = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    w = _weight(ints.shape[1], ints.device)
    step = _blocks_per_chunk(ints[0])
    out = [
        (ints[i : i + step].to(torch.int32) * w).sum(dim=1, dtype=torch.int64)
        for i in range(0, n, step)
    ]
    return out[0] if len(out) == 1 else torch.cat(out)


def cache_checksums(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Checksums of ``kv_cache[block_ids]`` (block-major cache), gathered a chunk at a time."""
    step = _blocks_per_chunk(kv_cache[0])
    out = []
    for i in range(0, len(block_ids), step):
        ids = torch.tensor(block_ids[i : i + step], device=kv_cache.device)
        out.append(block_checksums(kv_cache.index_select(0, ids)))
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=kv_cache.device)
    return out[0] if len(out) == 1 else torch.cat(out)
