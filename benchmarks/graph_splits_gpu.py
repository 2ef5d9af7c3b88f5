"""Decode attention's split count under CUDA graphs: the fixed rule against the occupancy rule.

    python benchmarks/graph_splits_gpu.py [--json out.json]

A decode graph is captured once per batch size and replayed for any context, so its split
count cannot follow the context as the eager path's does (``choose_num_splits`` over the
batch's longest sequence). ``graph_decode_splits`` gives ``64 // batch`` (about 64 programs per
head, whatever the model's context); the candidate applies the eager rule to ``max_model_len``
(one split for the demo's 256 positions, where batch 1 now takes 64 of 4 positions). This
times both on one random-weight Llama (head dim 128, GQA 8:2, float32, max_model_len 8192) with
CUDA graphs: per decode step (``single_stream.per_token_s`` over a batch of prompts of one
context), batches 1-64 x contexts 128-7000, and checks that the two rules give the same greedy
tokens. Needs CUDA; without it, exits 0 after saying so.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch
from offline_throughput import write_random_llama
from single_stream import per_token_s

BATCHES = (1, 8, 16, 32, 64)
CONTEXTS = (128, 2048, 7000)
MAX_LEN = 8192


def _occupancy(batch_size: int, num_kv_heads: int, max_model_len: int,
               device: torch.device) -> int:  # fmt: skip
    """The candidate: the eager path's rule at the longest context a replay can hold."""
    from tandem.kernels.decode_attention import choose_num_splits, num_sms

    return choose_num_splits(batch_size, num_kv_heads, max_model_len, num_sms(device))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("graph_splits_gpu.py: no CUDA device; nothing to measure")
        return 0
    from tandem import LLM, SamplingParams
    from tandem.engine import model_runner

    path = write_random_llama(args.hidden_size, args.num_layers, max_positions=MAX_LEN)
    rng = random.Random(0)
    fixed = model_runner.graph_decode_splits
    blocks = max(BATCHES) * -(-(max(CONTEXTS) + args.tokens) // 16) + 64
    options = {"device": "cuda", "max_num_seqs": max(BATCHES), "num_blocks": blocks,
               "max_model_len": MAX_LEN}  # fmt: skip
    prompts = {c: [[rng.randrange(4096) for _ in range(c)] for _ in range(max(BATCHES))]
               for c in CONTEXTS}  # fmt: skip
    results: dict = {"machine": torch.cuda.get_device_name(), "ms_per_step": {}, "splits": {}}
    outputs = {}
    for name, rule in (("fixed", fixed), ("occupancy", _occupancy)):
        model_runner.graph_decode_splits = rule
        llm = LLM(path, **options)
        kv_heads = llm.engine.runner.layout.num_kv_heads
        results["splits"][name] = {b: rule(b, kv_heads, MAX_LEN, torch.device("cuda"))
                                   for b in BATCHES}  # fmt: skip

        def gen(batch: list[list[int]], n: int, llm=llm) -> list[list[int]]:
            p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            return [o.token_ids for o in llm.generate(batch, p)]

        outputs[name] = gen(prompts[2048][:8], 16)
        if len(outputs) == 2:  # before the second rule's timings: a cut-off run still says it
            print(f"same greedy tokens: {outputs['fixed'] == outputs['occupancy']}", flush=True)
        rows = results["ms_per_step"].setdefault(name, {})
        for c in CONTEXTS:
            for b in BATCHES:
                batch = prompts[c][:b]
                ms = per_token_s(lambda k, batch=batch: gen(batch, k), args.tokens, 2) * 1e3
                rows[f"{b}x{c}"] = round(ms, 4)
                print(f"{name:9s} batch {b:3d} ctx {c:5d}: {ms:.3f} ms/step", flush=True)
        llm.engine.check_integrity()
        del llm
        torch.cuda.empty_cache()
    model_runner.graph_decode_splits = fixed
    results["same_tokens"] = outputs["fixed"] == outputs["occupancy"]
    f, o = results["ms_per_step"]["fixed"], results["ms_per_step"]["occupancy"]
    results["fixed_over_occupancy"] = {k: round(f[k] / o[k], 3) for k in f}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
