"""Decode attention on CPU alone, at the roofline benchmark's shapes, against memory bandwidth.

    python benchmarks/cpu_attention.py [--seqs 128] [--layers 4] [--hot] [--no-huge-pages]

The engine's KV layout ([block, layer, K/V, slot, head, dim], block-major as the connector moves
it) with --seqs sequences of 82-562 tokens (prompts of 32-512 plus 50 decoded, as in
step_roofline.py), their blocks scattered at random over a cache three times the used size.
One decode step's attention for every layer is timed (``cpu_ops.cpu_paged_attention``, the
fused forward's kernel); reported with the K/V bytes it reads and the GB/s that makes, beside
a plain ``torch.sum`` over a cold buffer as large (the machine's streaming read, same run).
``--hot``: every sequence reads the same first blocks (all in cache: the kernel's compute
bound). ``--no-huge-pages``: the cache on 4 KiB pages (engine/huge_pages.py off).
``--baseline-lib PATH``: another build of the kernel library (e.g. an older one from
``~/.cache/tandem/cpu_kernels``), timed in the same process in alternating rounds with the
current one; reported beside it with the ratio, and whether the two outputs are bit-equal.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from tandem.engine import huge_pages
from tandem.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 16  # the hidden-256 random Llama's attention


def timings(fn, repeats: int) -> tuple[float, float]:  # noqa: ANN001 - a thunk
    """(median, min) seconds of ``fn``; the min is the figure least touched by other tenants."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def alternated(
    fns: dict[str, Callable[[], None]], rounds: int, per_round: int = 5
) -> dict[str, list[float]]:
    """Seconds per call of each thunk, in rounds that alternate their order: a slow stretch of
    a shared machine then lands on every side rather than on one."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(per_round):
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - t0)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--no-huge-pages", action="store_true")
    ap.add_argument("--baseline-lib", help="another build of the kernel library to compare")
    a = ap.parse_args()
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(32, 512) + 50 for _ in range(a.seqs)]
    blocks = [(n + BLOCK - 1) // BLOCK for n in lens]
    total = 3 * sum(blocks)
    shape = (total, a.layers, 2, BLOCK, KV_HEADS, HEAD_DIM)
    if a.no_huge_pages:
        cache, advised = torch.empty(shape), False
    else:
        cache, advised = huge_pages.zeros(shape, torch.float32)
    cache.normal_()
    order = list(range(total))
    rng.shuffle(order)
    table = torch.zeros(a.seqs, max(blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.arange(nb) if a.hot else torch.tensor(order[used : used + nb])
        used += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(a.seqs, HEADS, HEAD_DIM)
    out = torch.empty_like(q)

    def step() -> None:
        for layer in range(a.layers):
            k, v = cache[:, layer, 0], cache[:, layer, 1]
            cpu_ops.cpu_paged_attention(q, k, v, table, seq_lens, HEAD_DIM**-0.5, out=out)

    attn_s, attn_min_s = timings(step, a.repeats)
    baseline = {}
    if a.baseline_lib:
        # The benchmark swaps the wrappers' library (a private global) between calls; the
        # checked wrapper, its arguments and the output buffer stay the same.
        current, other = cpu_ops._get(), cpu_ops._Lib(ctypes.CDLL(a.baseline_lib))
        out_current = out.clone()

        def on(lib: cpu_ops._Lib) -> Callable[[], None]:
            def run() -> None:
                cpu_ops._lib = lib
                try:
                    step()
                finally:
                    cpu_ops._lib = current

            return run

        samples = alternated({"current": on(current), "baseline": on(other)}, a.repeats)
        on(other)()  # `out` now holds the baseline's result
        med = {n: statistics.median(v) for n, v in samples.items()}
        baseline = {
            "alternated_current_ms": round(med["current"] * 1e3, 3),
            "alternated_baseline_ms": round(med["baseline"] * 1e3, 3),
            "baseline_over_current": round(med["baseline"] / med["current"], 3),
            "outputs_bit_equal": torch.equal(out, out_current),
        }
    kv_bytes = sum(lens) * a.layers * 2 * KV_HEADS * HEAD_DIM * 4
    cold = [torch.randn(kv_bytes // 4) for _ in range(4)]  # four, read in turn: none stays hot
    turn = iter(range(10**9))
    read_s, _ = timings(lambda: cold[next(turn) % 4].sum(), a.repeats)
    print(json.dumps({
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "seqs": a.seqs, "layers": a.layers, "hot": a.hot, "huge_pages": advised,
        "attention_ms": round(attn_s * 1e3, 3), "attention_min_ms": round(attn_min_s * 1e3, 3),
        "kv_mb": round(kv_bytes / 1e6, 1),
        "attention_gb_s": round(kv_bytes / attn_s / 1e9, 1),
        "streaming_read_gb_s": round(kv_bytes / read_s / 1e9, 1),
        "fraction_of_streaming_read": round(read_s / attn_s, 3),
        **baseline,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
