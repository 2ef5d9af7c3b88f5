"""A decode step's time warm, as `tandem profile` times it, and with other work between steps.

`tandem profile` times each grid point's steps back to back, after warm-up steps (the first
decode steps after the prefills run slow: ``engine/sim/profiler.py``), so its steps run with the
model's weights and the batch's KV in the core's caches. A served worker's steps have other
work between them: its own HTTP and streaming threads, the router, the load generator, all on
the same few cores. This measures what that costs the step itself (the span the worker's
``tandem_worker_busy_seconds_total`` counts: ``Engine.step``), in one process, with the work
between steps stood in for by each ``--between`` kind in turn:

- ``none``: steps back to back (the profile's timing);
- ``buffer:MB``: writing an MB-sized buffer (another process's data passing through the caches);
- ``json``: a JSON round trip of an OpenAI-style stream chunk list (Python serving code), about
  ``--json-kb`` KB.

Each batch size gets ``--steps`` timed steps per kind per round, the kinds interleaved over
``--rounds`` rounds (the host's pace moves over minutes). The table gives each kind's median
step over the ``none`` median at the same batch. The demo model (3 MB of weights) fits the
caches; random-512 (about 50 MB) does not (docs/planning.md, round 49).

    python benchmarks/plan_cache.py --model demo
    python benchmarks/plan_cache.py --model random-512 --ctx 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plan_validation import model_path


@dataclass(frozen=True, slots=True)
class Between:
    """One kind of work run before each timed step: ``name`` as ``--between`` spells it."""

    name: str
    run: Callable[[], None]


def parse_between(spec: str, json_kb: int) -> Between:
    """``none``, ``buffer:MB`` (MB > 0) or ``json``; anything else is a ValueError."""
    if spec == "none":
        return Between(spec, lambda: None)
    if spec == "json":
        chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "token"}}]}  # fmt: skip
        doc = [chunk] * max(1, json_kb * 1024 // len(json.dumps(chunk)))

        def round_trip() -> None:
            json.loads(json.dumps(doc))

        return Between(spec, round_trip)
    kind, _, size = spec.partition(":")
    if kind == "buffer":
        try:
            mb = float(size)
        except ValueError:
            mb = 0.0
        if mb > 0:
            buf = bytearray(int(mb * 2**20))
            view = memoryview(buf)
            fill = bytes(len(buf))

            def touch() -> None:
                view[:] = fill  # every cache line written

            return Between(spec, touch)
    raise ValueError(f"--between: expected none, buffer:MB (MB > 0) or json, got {spec!r}")


def ratios(medians: dict[str, float]) -> dict[str, float]:
    """Each kind's median step over the ``none`` kind's (the kinds' own order kept)."""
    base = medians["none"]
    return {k: v / base for k, v in medians.items()}


def table(rows: Sequence[tuple[int, dict[str, float]]]) -> str:
    """Markdown: per batch size, each kind's median step (ms) and its ratio to ``none``."""
    kinds = list(rows[0][1])
    lines = ["| batch | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for batch, med in rows:
        r = ratios(med)
        cells = [f"{med[k] * 1e3:.3f} ms ({r[k]:.2f}x)" for k in kinds]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=64, help="each sequence's prompt tokens")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per kind per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--between", default="none,buffer:1,buffer:4,buffer:16,json")
    ap.add_argument("--json-kb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the profile's)")
    args = ap.parse_args()
    kinds = [parse_between(s.strip(), args.json_kb) for s in args.between.split(",")]
    if "none" not in [k.name for k in kinds]:
        raise SystemExit("--between must include none (the baseline)")
    batches = [int(b) for b in args.batches.split(",")]
    from tandem.engine.builder import build_engine_parts
    from tandem.engine.cpu_threads import set_engine_threads
    from tandem.engine.engine import Engine
    from tandem.engine.llm import build_engine_config
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.sim.profiler import WARMUP_STEPS  # the first decode steps run slow

    set_engine_threads(args.threads)
    config = build_engine_config(model_path(args.model), device="cpu", dtype="float32")
    engine = Engine(build_engine_parts(config))
    room = WARMUP_STEPS + args.steps * len(kinds) * args.rounds
    if args.ctx + room + 1 > engine.max_model_len:
        raise SystemExit(f"--ctx {args.ctx} leaves less than {room} tokens of context room")
    vocab = [t for t in range(engine.arch.vocab_size) if t not in engine.eos_token_ids]
    rng = random.Random(0)
    rows = []
    for batch in batches:
        ids = [f"cache-{batch}-{i}" for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
        for rid in ids:
            engine.add_request(rid, [rng.choice(vocab) for _ in range(args.ctx)], params)
        sched = engine.scheduler
        while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        times: dict[str, list[float]] = {k.name: [] for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                for _ in range(args.steps):
                    k.run()
                    t0 = time.perf_counter()
                    engine.step()
                    times[k.name].append(time.perf_counter() - t0)
        engine.abort(ids)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((batch, med))
        print(f"batch {batch}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in med.items()),
              flush=True)  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
