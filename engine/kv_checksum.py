"""The cheap checksum every KV block copy is checked against (host tier and peer pulls).

A position-weighted sum of the block's bytes read as 16-bit integers (8-bit for 1-byte dtypes):
it catches a flipped bit, a zeroed or stale block and blocks swapped with each other, and is
computed on the tensor's own device. It runs as a float64 matrix-vector product (BLAS), yet is
exact: |x| < 2**15 and weights < 2**16, so every partial sum over a segment of at most 2**20
elements is an integer below 2**52, which float64 holds exactly whatever the reduction order;
segments add up in int64. The same bytes give the same checksum on CPU and GPU, in any process.
"""

from __future__ import annotations

import torch

_MODULUS = 65521  # prime, so weights repeat only every 65521 positions
_STRIDE = 40503
_SEGMENT = 1 << 20  # elements per exact float64 partial sum
# Blocks are gathered and converted at most this many bytes of float64 at a time.
_CHUNK_BYTES = 64 << 20
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weight(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    w = _weights.get(key)
    if w is None:
        idx = torch.arange(n, dtype=torch.int64, device=device)
        w = ((idx * _STRIDE) % _MODULUS + 1).to(torch.float64)
        _weights[key] = w
    return w


def _blocks_per_chunk(block: torch.Tensor) -> int:
    ints_per_block = block.numel() * block.element_size() // (1 if block.element_size() == 1 else 2)
    return max(1, _CHUNK_BYTES // (8 * ints_per_block))


def block_checksums(blocks: torch.Tensor) -> torch.Tensor:
    """One int64 checksum per block of ``blocks`` (shape [n, ...], any KV dtype), on its device."""
    n = blocks.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=blocks.device)
    flat = blocks.contiguous().reshape(n, -1)
    ints = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    w = _weight(ints.shape[1], ints.device)
    step = _blocks_per_chunk(blocks[0])
    out = []
    for i in range(0, n, step):
        total = torch.zeros(min(step, n - i), dtype=torch.int64, device=ints.device)
        for a in range(0, ints.shape[1], _SEGMENT):
            seg = ints[i : i + step, a : a + _SEGMENT].to(torch.float64)
            total += (seg @ w[a : a + _SEGMENT]).to(torch.int64)
        out.append(total)
    return out[0] if len(out) == 1 else torch.cat(out)


def cache_checksums(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Checksums of ``kv_cache[block_ids]`` (block-major cache), gathered a chunk at a time."""
    step = _blocks_per_chunk(kv_cache[0])
    out = []
    for i in range(0, len(block_ids), step):
        ids = torch.tensor(block_ids[i : i + step], device=kv_cache.device)
        out.append(block_checksums(kv_cache[ids]))
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=kv_cache.device)
    return out[0] if len(out) == 1 else torch.cat(out)
