"""The engine on CUDA: CUDA graphs against eager against the CPU engine, outputs and speed.

    python benchmarks/engine_gpu.py [--hidden-size 1024] [--num-layers 8] [--json out.json]

A random-weight Llama (head dim 128, GQA 8:2, float32, so every path is held to the CPU's
tokens exactly) runs three ways in one process:
- **Parity:** greedy outputs of the same prompts from CUDA graphs, CUDA eager and the CPU
  engine; any difference exits 1.
- **Batch throughput:** ``--num-requests`` prompts of ``--prompt-len`` tokens, ``--tokens``
  each, through ``LLM.generate`` (out tokens per second), graphs and eager.
- **Single stream:** one request's inter-token latency, (t(N tokens) - t(1 token)) / (N - 1)
  (``single_stream.per_token_s``), graphs, eager and Hugging Face ``generate`` on the GPU.

Needs CUDA; without it, exits 0 after saying so (CI has no GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch
from offline_throughput import write_random_llama
from single_stream import hf, per_token_s


def _generate(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from tandem import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _throughput(llm, prompts: list[list[int]], tokens: int) -> float:
    _generate(llm, prompts[:8], 4)  # warm-up: allocations, Triton's compiles, graph capture
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = _generate(llm, prompts, tokens)
    torch.cuda.synchronize()
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--parity-requests", type=int, default=16)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("engine_gpu.py: no CUDA device; nothing to measure")
        return 0
    from tandem import LLM

    path = write_random_llama(args.hidden_size, args.num_layers)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]  # fmt: skip
    few = prompts[: args.parity_requests]
    # Two engines share the GPU: a fixed KV cache each (room for every request at once), not
    # gpu_memory_utilization, which budgets the whole GPU and would count the first engine's
    # cache against the second.
    blocks = args.num_requests * -(-(args.prompt_len + args.tokens) // 16) + 64
    options = {"device": "cuda", "max_num_seqs": 256, "num_blocks": blocks}
    graphs = LLM(path, **options)
    eager = LLM(path, enforce_eager=True, **options)
    cpu = LLM(path)
    ref = _generate(cpu, few, 32)
    parity = {
        "graphs_equal_cpu": _generate(graphs, few, 32) == ref,
        "eager_equal_cpu": _generate(eager, few, 32) == ref,
    }
    result = {
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{platform.python_version()}",
        "model": f"random Llama, hidden {args.hidden_size}, {args.num_layers} layers, float32",
        "parity": parity,
        "throughput_tok_s": {
            "graphs": _throughput(graphs, prompts, args.tokens),
            "eager": _throughput(eager, prompts, args.tokens),
        },
        "single_stream_ms_per_token": {},
    }
    one = prompts[0][:64]
    single = result["single_stream_ms_per_token"]
    for name, llm, n, repeats in (("graphs", graphs, 128, 5), ("eager", eager, 128, 5),
                                  ("cpu", cpu, 32, 3)):  # fmt: skip
        single[name] = per_token_s(lambda k, llm=llm: _generate(llm, [one], k), n, repeats) * 1e3
    single["hf_cuda"] = hf(path, one, 128, 5, device="cuda") * 1e3
    for llm in (graphs, eager, cpu):
        llm.engine.check_integrity()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(parity.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
