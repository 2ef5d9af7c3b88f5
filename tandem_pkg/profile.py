"""``tandem profile``: measure the cost model the simulator and simulated workers need.

``main(argv) -> int`` is called by ``tandem.cli``. It builds the real engine with the serving
engine options, times its steps over a grid of batch shapes (``tandem.engine.sim.profiler``),
times KV pulls against bytes for each transport (``tandem.kvtransfer.transfer_profile``), fits
the linear models and writes one profile JSON with the raw points (``tandem.engine.sim.profile``).
A progress bar counts grid points.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

from tandem.engine.sim.profile import EngineFacts, ModelFacts, Profile, TransferPoint

TRANSPORTS = ("tcp", "ucx")


def build_parser() -> argparse.ArgumentParser:
    from tandem.engine.worker.cli import engine_option

    p = argparse.ArgumentParser(
        prog="tandem profile",
        description="Measure step and KV transfer times of the real engine on this machine.",
    )
    p.add_argument("--model", default="demo", help="'demo' or a local Hugging Face directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--engine-option", action="append", type=engine_option, default=[],
                   metavar="KEY=VALUE", help="as the workers will run (repeatable)")  # fmt: skip
    p.add_argument("--output", required=True, metavar="PROFILE.json")
    p.add_argument("--transports", default="tcp,ucx",
                   help="comma-separated KV transports to time (default tcp,ucx)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=9,
                   help="timed steps per grid point and pass")  # fmt: skip
    p.add_argument("--passes", type=int, default=3,
                   help="passes over the grid, each followed by a segment of the serving "
                   "stage; a point's time is its lower quartile over every pass, a serving "
                   "latency the median over segments (the machine's pace moves over "
                   "minutes)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="the engine's CPU threads, as each worker will run (`tandem up "
                   "--worker-threads`); default: a worker's own default")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smaller grid (tests, smoke runs)")
    p.add_argument("--no-serving", action="store_true",
                   help="skip measuring the router's and worker shell's latencies through "
                   "simulated workers (keeps the defaults)")  # fmt: skip
    return p


def _transfer_models(points: list[TransferPoint]) -> dict:
    from tandem.engine.sim.cost_model import TRANSFER_FEATURES, fit_linear

    models = {}
    for t in sorted({p.transport for p in points}):
        pts = [p for p in points if p.transport == t]
        xs = [(1.0, float(p.num_bytes)) for p in pts]
        models[t] = fit_linear(TRANSFER_FEATURES, xs, [p.seconds for p in pts])
    return models


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        raise SystemExit(f"tandem profile: --transports must name tcp and/or ucx, got {bad}")
    from tandem.engine.sim.profiler import REPEATS_ROOM

    if not 1 <= args.repeats <= REPEATS_ROOM:
        raise SystemExit(
            f"tandem profile: --repeats must be 1 to {REPEATS_ROOM} (the context room a decode "
            f"point keeps for its timed steps), got {args.repeats}"
        )
    if not 1 <= args.passes <= 10:
        raise SystemExit(f"tandem profile: --passes must be 1 to 10, got {args.passes}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("tandem profile: --threads must be >= 1")
    from tandem.engine.cpu_threads import default_threads, set_engine_threads

    threads = args.threads if args.threads is not None else default_threads()
    set_engine_threads(threads)
    from tqdm import tqdm

    from tandem.engine.builder import build_engine_parts
    from tandem.engine.engine import Engine
    from tandem.engine.llm import build_engine_config
    from tandem.engine.sim.cost_model import StepCost, TransferCost
    from tandem.engine.sim.profiler import StepProfiler, default_grid, fit_step_models
    from tandem.engine.sim.tokens import printable_token_ids
    from tandem.kvtransfer.transfer_profile import measure_transfers

    try:
        config = build_engine_config(
            args.model, device=args.device, dtype=args.dtype, **dict(args.engine_option)
        )
        engine = Engine(build_engine_parts(config))
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"tandem profile: {exc}") from None
    sched = engine.scheduler.config
    layout = engine.layout
    grid = default_grid(
        engine.max_model_len, sched.max_num_batched_tokens, sched.max_num_seqs,
        layout.num_blocks, layout.block_size, quick=args.quick,
    )  # fmt: skip
    max_blocks = -(-engine.max_model_len // layout.block_size)
    counts = sorted({1, *[2**i for i in range(max_blocks.bit_length()) if 2**i <= max_blocks],
                     max_blocks})  # fmt: skip
    if args.quick:
        counts = sorted({1, max_blocks})
    serving = not args.no_serving
    if serving and (args.device, args.dtype) != ("cpu", "float32"):
        print("tandem profile: `tandem up` runs workers on the CPU in float32 only: skipping the "
              "serving stage (its defaults stay in the profile)", file=sys.stderr)  # fmt: skip
        serving = False
    arch = engine.arch
    eos = frozenset(engine.eos_token_ids)
    sim_tokens = printable_token_ids(engine.tokenizer, arch.vocab_size, eos)
    bar = tqdm(total=args.passes * grid.size + len(counts) * len(transports),
               desc="tandem profile", unit="point", file=sys.stderr)  # fmt: skip
    transfer_points: list[TransferPoint] = []
    for t in transports:
        try:
            transfer_points += measure_transfers(
                t, layout, counts, args.repeats, lambda: bar.update(1)
            )
        except (ImportError, RuntimeError, OSError) as exc:
            bar.update(len(counts))
            print(f"tandem profile: skipping {t}: {exc}", file=sys.stderr)
    if not transfer_points:
        bar.close()
        raise SystemExit("tandem profile: no KV transport could be timed")
    # The serving stage's P/D hand-off runs over TCP where it was timed (the tests' transport).
    transport = min({p.transport for p in transfer_points}, key=lambda t: t != "tcp")
    from tandem.calibrate import CPU_REQUESTS, ServingSample, measure_serving, serving_cost

    profiler = StepProfiler(engine, repeats=args.repeats)
    segments: list[ServingSample] = []
    for i in range(args.passes):
        points = profiler.run(grid, lambda: bar.update(1))
        if serving:
            # Between the passes, so the serving latencies are measured in the same stretches
            # of the machine's pace as the steps subtracted from them. The engine here idles.
            bar.set_postfix_str(f"serving segment {i + 1}/{args.passes}")
            options = [f"{k}={v}" for k, v in args.engine_option]
            requests = -(-CPU_REQUESTS // args.passes)
            try:
                segments.append(measure_serving(args.model, transport, sim_tokens, options,
                                                threads, requests, seed=i))  # fmt: skip
            except (RuntimeError, ValueError, OSError) as exc:
                raise SystemExit(f"tandem profile: the serving stage failed: {exc}") from None
            bar.set_postfix_str("")
    bar.close()
    execute, host, fit = fit_step_models(points)
    import torch

    profile = Profile(
        model=ModelFacts(
            name=args.model, architecture=arch.architecture, vocab_size=arch.vocab_size,
            num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            dtype=layout.dtype, max_model_len=engine.max_model_len,
            eos_token_ids=tuple(sorted(eos)), sim_token_ids=sim_tokens,
        ),
        engine=EngineFacts(
            device=args.device, block_size=layout.block_size, num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
        ),
        step=StepCost(execute, host),
        transfer=TransferCost(_transfer_models(transfer_points)),
        step_points=tuple(points),
        transfer_points=tuple(transfer_points),
        fit=fit,
        created=datetime.datetime.now(tz=datetime.UTC).isoformat(timespec="seconds"),
        hardware={
            "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
        },
    )  # fmt: skip
    if segments:
        from dataclasses import replace

        try:
            profile = replace(profile, serving=serving_cost(profile, segments, transport))
        except ValueError as exc:
            raise SystemExit(f"tandem profile: the serving stage failed: {exc}") from None
    profile.save(args.output)
    if fit["sample_spread"] > 0.5:
        print(f"tandem profile: warning: step times vary a lot between repeats (spread "
              f"{fit['sample_spread']:.1f}); other work is running: profile on a quiet machine",
              file=sys.stderr)  # fmt: skip
    print(
        f"tandem profile: {len(points)} step points (execute fit: median error "
        f"{fit['execute_rel_error_p50']:.1%}, p90 {fit['execute_rel_error_p90']:.1%}), "
        f"{len(transfer_points)} transfer points, {layout.num_blocks} KV blocks, serving "
        f"{profile.serving}; wrote {args.output}"
    )
    return 0
