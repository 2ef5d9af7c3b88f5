"""Offline throughput: Tandem's engine vs Hugging Face `generate` with static batches, one run.

    python benchmarks/offline_throughput.py [--model demo] [--num-requests 256]

Workload: prompt lengths uniform in [32, 512], output lengths uniform in [16, 256], greedy,
EOS ignored so both sides generate exactly the requested lengths. HF runs left-padded static
batches of --hf-batch-size (each batch generates until its longest request's length; tokens past
a request's own length are not counted). Also reports the engine thread's own time per step
(scheduling, input preparation, output processing) with --overhead-seqs decoding sequences, as
measured by benchmarks/step_roofline.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

# --clock cpu: process CPU time, for shared machines where wall time mostly measures the other
# jobs (both sides are then charged only for their own work). Quiet-machine figures use wall time.
clock = time.perf_counter


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_engine(model: str, reqs: list[tuple[list[int], int]], options: dict) -> tuple[float, int]:
    from tandem import LLM, SamplingParams

    llm = LLM(model, **options)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = clock()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = clock() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def run_hf(path: str, reqs: list[tuple[list[int], int]], batch_size: int) -> tuple[float, int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = clock()
    total = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in batch),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        total += sum(m for _, m in batch)
    return clock() - start, total


def write_random_llama(hidden: int = 256, layers: int = 4, printable: bool = False,
                       max_positions: int = 2048) -> str:  # fmt: skip
    """A random-weight Llama (seeded) with the demo's byte tokenizer, written to a temp dir.

    ``printable``: the tokenizer's own vocabulary and an LM head that is zero outside the
    printable-ASCII rows, so every greedy token is one character of text (with the hidden state
    random, the largest of 95 random logits is above zero). A random head over the 4096-token
    vocabulary streams mostly fragments of UTF-8 sequences, whose text the router holds back
    until they complete: what a client then times is not the engine (plan_validation.py)."""
    import tempfile

    import transformers

    from tandem.engine.demo.tokenizer_build import VOCAB_SIZE, build_tokenizer

    out = tempfile.mkdtemp(prefix="tandem-bench-")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE if printable else 4096,
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if printable:
        with torch.no_grad():
            keep = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
            keep[32:127] = True
            model.lm_head.weight[~keep] = 0.0
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="random-llama",
        help="a local HF directory, 'demo', or 'random-llama' (a random-weight Llama, 8 query / "
        "2 KV heads, vocab 4096, 2k context, sized by --hidden-size and --num-layers, written "
        "to a temp dir)",
    )
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hidden-size", type=int, default=256, help="random-llama only")
    ap.add_argument("--num-layers", type=int, default=4, help="random-llama only")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--overhead-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from tandem.engine.model_path import resolve_model_path
    from tandem.engine.models.loader import read_hf_config

    if args.model == "random-llama":
        args.model = write_random_llama(args.hidden_size, args.num_layers)
    path = resolve_model_path(args.model)
    vocab = read_hf_config(path)["vocab_size"]
    reqs = workload(args.num_requests, vocab, args.seed)
    options = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}
    eng_s, eng_tok = run_engine(args.model, reqs, options)
    hf_s, hf_tok = run_hf(str(path), reqs, args.hf_batch_size)
    assert eng_tok == hf_tok, (eng_tok, hf_tok)
    import step_roofline
    from step_roofline import engine_overhead

    step_roofline.clock = clock
    overhead = engine_overhead(args.model, args.overhead_seqs, steps=20)
    result = {
        "model": args.model,
        "clock": args.clock,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "requests": args.num_requests,
        "output_tokens": eng_tok,
        "engine_tok_s": eng_tok / eng_s,
        "hf_tok_s": hf_tok / hf_s,
        "ratio": (eng_tok / eng_s) / (hf_tok / hf_s),
        **{f"overhead_{k}": v for k, v in overhead.items() if k != "seqs"},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
