"""Decode attention's launch choices on CUDA: a sweep of splits x KV tile x warps x stages.

    python benchmarks/decode_tuning_gpu.py [--dtype bf16] [--json out.json] [--quick]

For each of ``kernels_gpu.py``'s decode shapes (Llama-3-8B heads, block 16, shuffled block
tables), every configuration is checked against gather + SDPA (a mismatch exits 1) and timed;
the table gives the default launch's bandwidth (``choose_num_splits``, BLOCK_N 64, Triton's
warps and stages) as a share of device-copy bandwidth, the best configuration's, and the best
configuration. This is the evidence for the defaults in ``kernels/decode_attention.py``, not a
test. Without CUDA only ``--quick`` runs (one tiny shape under TRITON_INTERPRET=1, a smoke test
of the script); otherwise it exits 0 after saying so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from kernels_gpu import (
    DTYPES,
    HEAD_DIM,
    HKV,
    HQ,
    PARITY_TOL,
    PagedCase,
    bench_ms,
    check,
    copy_bandwidth_gbps,
    sdpa,
)  # fmt: skip

from tandem.kernels.decode_attention import choose_num_splits, paged_decode_attention

SHAPES = [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (1024, 4096, 16384) if b * c <= 2**20]
SPLITS, TILES, WARPS, STAGES = (1, 2, 4, 8), (32, 64, 128), (4, 8), (2, 3)


def _ms(fn, device: torch.device) -> float:
    if device.type != "cuda":
        return bench_ms(fn, device)
    import triton.testing

    # Short runs: hundreds of configurations; do_bench's median over ~20 ms is stable to ~1 %.
    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))


def sweep(
    batch: int, ctx: int, dtype: torch.dtype, device: torch.device, copy_gbps: float,
    configs: list[tuple[int, int, int, int]], failures: list[str],
) -> dict:  # fmt: skip
    case = PagedCase(batch, ctx, dtype, device)
    q = torch.randn((batch, HQ, HEAD_DIM), dtype=dtype, device=device)
    out = torch.empty_like(q)
    k, v = case.gather()
    want = sdpa(q[:, :, None], k, v, None)[:, :, 0]
    del k, v
    elem = q.element_size()
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * elem + 2 * q.numel() * elem
    nbytes += case.block_tables.numel() * 4

    def frac(ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9 / copy_gbps

    def launch(**kw) -> float:
        def run() -> torch.Tensor:
            return paged_decode_attention(
                q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, HEAD_DIM**-0.5,
                out=out, max_seq_len=ctx, **kw,
            )  # fmt: skip

        out.fill_(float("nan"))
        check(f"decode b={batch} ctx={ctx} {kw}", run(), want, PARITY_TOL[dtype], failures)
        return _ms(run, device)

    default_ms = launch()
    timed = []
    for splits, tile, warps, stages in configs:
        cfg = {"num_splits": splits, "block_n": tile, "num_warps": warps, "num_stages": stages}
        timed.append((launch(**cfg), cfg))
    best_ms, best = min(timed, key=lambda t: t[0])
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    return {
        "batch": batch, "ctx": ctx, "default_splits": choose_num_splits(batch, HKV, ctx, sms),
        "default_ms": default_ms, "default_frac": frac(default_ms),
        "best_ms": best_ms, "best_frac": frac(best_ms), "best": best,
        "all": [{"ms": ms, **cfg} for ms, cfg in timed],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--json", help="also write every timing here")
    ap.add_argument("--quick", action="store_true", help="one small shape, four launches")
    for flag, values in (
        ("splits", SPLITS),
        ("tiles", TILES),
        ("warps", WARPS),
        ("stages", STAGES),
    ):
        ap.add_argument(f"--{flag}", default=",".join(map(str, values)),
                        help=f"comma-separated values to sweep (default {values})")  # fmt: skip
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("decode_tuning_gpu.py: no CUDA device; nothing to measure (--quick: a smoke test)")
        return 0
    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype] if cuda else torch.float32
    shapes = [(2, 300)] if args.quick else SHAPES
    axes = [[int(v) for v in getattr(args, f).split(",")] for f in ("splits", "tiles", "warps",
                                                                    "stages")]  # fmt: skip
    grid = itertools.product(*(((1, 3), (32,), (4,), (2, 3)) if args.quick else axes))
    configs = list(grid)
    copy_gbps = copy_bandwidth_gbps(device, 2**30 if cuda else 2**20)
    failures: list[str] = []
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    print(f"device: {name}  dtype: {dtype}  copy {copy_gbps:.0f} GB/s")
    print(f"{'case':<18} {'default':>22} {'best':>16}  best launch (splits, tile, warps, stages)")
    rows = []
    for batch, ctx in shapes:
        r = sweep(batch, ctx, dtype, device, copy_gbps, configs, failures)
        rows.append(r)
        b = r["best"]
        print(f"b={batch:<3} ctx={ctx:<6} {r['default_ms']:8.4f} ms {100 * r['default_frac']:3.0f}%"
              f" (s={r['default_splits']}) {r['best_ms']:8.4f} ms {100 * r['best_frac']:3.0f}%  "
              f"{b['num_splits']}, {b['block_n']}, {b['num_warps']}, {b['num_stages']}",
              flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": str(dtype),
                       "copy_gbps": copy_gbps, "rows": rows, "failures": failures}, f)  # fmt: skip
    for line in failures:
        print(f"PARITY FAILURE: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
