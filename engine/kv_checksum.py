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
# Blocks are checksummed this many bytes at a time, bounding the int32 temporary.
_CHUNK_BYTES = 64 << 20
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weight(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    w = _weights.get(key)
    if w is None:
        idx = torch.arange(n, dtype=torch.int64, device=device)
        w = ((idx * _STRIDE) % _MODULUS + 1).to(torch.int32)
        _weights[key] = w
    return w


def block_checksums(blocks: torch.Tensor) -> torch.Tensor:
    """One int64 checksum per block of ``blocks`` (shape [n, ...], any KV dtype), on its device."""
    n = blocks.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=blocks.device)
    flat = blocks.contiguous().reshape(n, -1)
    ints = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    w = _weight(ints.shape[1], ints.device)
    per_chunk = max(1, _CHUNK_BYTES // max(1, ints.shape[1] * 4))
    out = [
        (ints[i : i + per_chunk].to(torch.int32) * w).sum(dim=1, dtype=torch.int64)
        for i in range(0, n, per_chunk)
    ]
    return out[0] if len(out) == 1 else torch.cat(out)
