"""A decode step against the machine's matmul limit, and the engine thread's own time per step.

    python benchmarks/step_roofline.py [--hidden-size 256] [--seqs 128] [--overhead-seqs 256]

1. Roofline: the engine decodes --seqs sequences (prompts uniform in 32-512 tokens, as in
   offline_throughput.py) at steady state. In the same process, every matrix product of one
   decode step (the four projections of each layer and the LM head, at M = --seqs rows) is timed
   alone with torch on warm weights: their sum is the step's matmul-bound time, the least a step
   can take with this BLAS on this machine. Reported: the step's median time and
   ``matmul_bound_fraction = matmul-bound time / step time`` (1.0 would be a step doing nothing
   but its matrix products), taken per round over --rounds alternating rounds of steps and
   matmuls; the median round is reported. The GEMM throughput at those shapes and at a large square
   (the machine's float32 peak through torch) is reported beside it.
2. Engine-thread overhead at --overhead-seqs decoding sequences: the median per step of
   everything `Engine.step()` does besides the model, the logits and the sampler, i.e.
   scheduling, input preparation and output processing (Scheduler.update and the outputs).
   A steady step's outputs are made by whoever reads them (engine/outputs.py StepOutputs): the
   time to read them is reported apart (``reader_makes_outputs_ms``), off the engine thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
from offline_throughput import write_random_llama

# --clock cpu (process CPU time) keeps a shared, oversubscribed machine's descheduling out of the
# figures; a quiet machine's report uses wall time (the default).
clock = time.perf_counter


def timed(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return statistics.median(samples)


def decoding_engine(path: str, num_seqs: int, prompt_range: tuple[int, int]):
    from tandem import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=num_seqs, max_num_batched_tokens=4096)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(engine.arch.vocab_size) for _ in range(rng.randint(*prompt_range))]
        engine.add_request(f"s{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


class Stopwatch:
    """Wraps named methods of objects and accumulates their wall time per step."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._originals: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        for obj, name, original in reversed(self._originals):
            setattr(obj, name, original)

    def wrap(self, obj: object, name: str, key: str) -> None:
        original = getattr(obj, name)
        self._originals.append((obj, name, original))

        def timed_call(*args, **kwargs):
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[key] = self.spent.get(key, 0.0) + clock() - t0

        setattr(obj, name, timed_call)


def roofline(path: str, num_seqs: int, steps: int, rounds: int) -> dict[str, object]:
    engine = decoding_engine(path, num_seqs, (32, 512))
    model = engine.runner.model
    weights = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight]
        weights += [mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(num_seqs, w.shape[1]) for w in weights}
    flops = sum(2 * num_seqs * w.shape[0] * w.shape[1] for w in weights)
    # Step and matmuls are timed in alternating rounds and their ratio taken per round: another
    # tenant's burst then slows both sides of one ratio instead of one side of the only one.
    per_round = []
    with torch.inference_mode():
        for _ in range(rounds):
            step_s = timed(engine.step, steps)
            matmul_s = sum(timed(lambda w=w: torch.nn.functional.linear(inputs[w.shape[1]], w))
                           for w in weights)  # fmt: skip
            per_round.append((matmul_s / step_s, step_s, matmul_s))
        big = torch.randn(2048, 2048)
        peak_s = timed(lambda: big @ big, 5)
    engine.abort([f"s{i}" for i in range(num_seqs)])
    fraction, step_s, matmul_s = sorted(per_round)[len(per_round) // 2]
    return {
        "seqs": num_seqs,
        "step_ms": step_s * 1e3,
        "matmul_bound_ms": matmul_s * 1e3,
        "matmul_bound_fraction": fraction,
        "fraction_per_round": [round(f, 3) for f, _, _ in per_round],
        "gemm_gflops_at_step_shapes": flops / matmul_s / 1e9,
        "gemm_gflops_2048_square": 2 * 2048**3 / peak_s / 1e9,
    }


def engine_overhead(path: str, num_seqs: int, steps: int) -> dict[str, float]:
    engine = decoding_engine(path, num_seqs, (64, 64))
    watch = Stopwatch()
    runner = engine.runner
    if runner.cpu_forward is not None:
        watch.wrap(runner.cpu_forward, "run", "model")
    else:
        watch.wrap(runner.model, "forward", "model")
    watch.wrap(runner.model, "compute_logits", "logits")
    watch.wrap(type(runner.sampler), "__call__", "sampler")  # special methods live on the class
    watch.wrap(runner.sampler, "greedy", "greedy")
    watch.wrap(engine.scheduler, "schedule", "schedule")
    watch.wrap(runner, "prepare", "prepare")
    watch.wrap(engine.scheduler, "update", "update")
    # Detokenization, while it still runs on the engine thread (issue 15 part 3 moves it out).
    if getattr(engine, "_detok", None) is not None:
        from tandem.engine.detokenizer import IncrementalDetokenizer

        watch.wrap(IncrementalDetokenizer, "append", "detokenize")
    rows = []
    for _ in range(steps):
        watch.spent.clear()
        t0 = clock()
        outs = engine.step()
        total = clock() - t0
        # A steady step's EngineOutputs are made by their reader (StepOutputs): in a worker the
        # event loop, while the engine thread runs the next forward pass. Timed apart.
        t0 = clock()
        list(outs)
        read = clock() - t0
        s = watch.spent
        rows.append({
            "step": total, "schedule": s["schedule"], "prepare": s["prepare"],
            # All-greedy batches call Sampler.greedy only; others call the Sampler itself.
            "engine_thread": total - s["model"] - s["logits"] - s.get("sampler", 0.0)
            - s.get("greedy", 0.0),
            "detokenize": s.get("detokenize", 0.0),
            "read": read,
        })  # fmt: skip
    watch.restore()
    engine.abort([f"s{i}" for i in range(num_seqs)])
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    return {
        "seqs": num_seqs,
        "step_ms": med["step"],
        "schedule_ms": med["schedule"],
        "prepare_ms": med["prepare"],
        "engine_thread_ms": med["engine_thread"],
        "of_which_detokenize_ms": med["detokenize"],
        "engine_thread_without_detokenize_ms": med["engine_thread"] - med["detokenize"],
        "reader_makes_outputs_ms": med["read"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--overhead-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    path = write_random_llama(args.hidden_size, args.num_layers)
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "model": f"random Llama, hidden {args.hidden_size}, {args.num_layers} layers",
        "clock": args.clock,
        "roofline": roofline(path, args.seqs, args.steps, args.rounds),
        "overhead": engine_overhead(path, args.overhead_seqs, args.steps),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
