"""Shared cases of the paged-attention kernel tests (Triton and CPU): head layouts, a block-major
cache of random data, shuffled block tables and packed extend chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_LAYERS = 2
LAYER = 1
ATOL = 2e-6
RTOL = 1e-5


@dataclass(frozen=True, slots=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


# GQA ratios 1, 4 and 8 (the last also MQA), head dims 64/80/96/128, block sizes 16 and 32; the
# group of 3 with head dim 96 covers a non-power-of-two group.
HEADS = [
    Heads(4, 4, 64, 16),
    Heads(8, 2, 80, 32),
    Heads(8, 1, 128, 16),
    Heads(6, 2, 96, 32),
]
HEADS_IDS = [f"hq{h.num_heads}-hkv{h.num_kv_heads}-d{h.head_dim}-bs{h.block_size}" for h in HEADS]


def make_kv_cache(heads: Heads, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    shape = (num_blocks, NUM_LAYERS, 2, heads.block_size, heads.num_kv_heads, heads.head_dim)
    return torch.randn(shape, generator=gen)


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Disjoint random blocks per sequence, in shuffled order; unused entries 0."""
    need = [-(-n // block_size) for n in seq_lens]
    width = max(need) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    used = 0
    for i, count in enumerate(need):
        table[i, :count] = perm[used : used + count]
        used += count
    return table


def slots_for(block_table: torch.Tensor, positions: range, block_size: int) -> list[int]:
    return [int(block_table[p // block_size]) * block_size + p % block_size for p in positions]


@dataclass(frozen=True, slots=True)
class Chunk:
    context_len: int  # tokens already cached
    query_len: int  # new tokens this step


# A first prompt token alone, a whole prompt ending on a block boundary, a prefix-cache hit of
# exactly one block, a chunk straddling boundaries, a decode row in a mixed batch, a long chunk.
CHUNKS = [Chunk(0, 1), Chunk(0, 17), Chunk(16, 16), Chunk(15, 18), Chunk(32, 1), Chunk(1, 32)]


def pack_chunks(chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    seq_lens = [c.context_len + c.query_len for c in chunks]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.query_len)
    return (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens,
    )


# Sliding windows: 1 (a row sees only itself), shorter than a block, block - 1, one block, one
# more, and longer than every sequence (the same as no window).
WINDOW_CASES = [1, 5, 15, 16, 17, 1000]
