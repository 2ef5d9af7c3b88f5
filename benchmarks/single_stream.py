"""Single-stream decode latency: one request, nothing else running, Tandem vs Hugging Face
`generate` at batch 1, in one process, back to back.

    python benchmarks/single_stream.py [--hidden-size 256] [--num-layers 4] [--tokens 256]

Inter-token latency on each side is (time for N tokens - time for 1 token) / (N - 1), so the
prompt's prefill and start-up costs cancel out. Tandem runs `LLM.generate` (the offline engine
loop: scheduler, input preparation, model, sampler, output processing) with the defaults (the
fused CPU forward), then with ``enforce_eager=True`` (eager model on the CPU kernels) and with
``cpu_kernels=False`` (the PyTorch path), each as a ratio to HF measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch
from offline_throughput import write_random_llama

# --clock cpu: process CPU time, for shared machines where wall time mostly measures the other
# jobs (both sides are then charged only for their own work). Quiet-machine figures use wall time.
clock = time.perf_counter


def per_token_s(generate, n: int, repeats: int) -> float:
    """Median over repeats of (t(n tokens) - t(1 token)) / (n - 1)."""
    generate(n)  # warm-up (allocations, the CPU kernels' build, caches)
    samples = []
    for _ in range(repeats):
        t0 = clock()
        generate(1)
        t1 = clock()
        generate(n)
        t2 = clock()
        samples.append(((t2 - t1) - (t1 - t0)) / (n - 1))
    return statistics.median(samples)


def tandem(path: str, prompt: list[int], n: int, repeats: int, **options) -> float:
    from tandem import LLM, SamplingParams

    llm = LLM(path, **options)

    def generate(k: int) -> None:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        assert len(out[0].token_ids) == k

    return per_token_s(generate, n, repeats)


def hf(path: str, prompt: list[int], n: int, repeats: int, device: str = "cpu") -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def generate(k: int) -> None:
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert out.shape[1] == len(prompt) + k
        if device != "cpu":
            torch.cuda.synchronize()  # the timer must see the GPU's work done

    return per_token_s(generate, n, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    path = write_random_llama(args.hidden_size, args.num_layers)
    rng = random.Random(0)
    prompt = [rng.randrange(4096) for _ in range(args.prompt_len)]
    n, r = args.tokens, args.repeats
    hf_s = hf(path, prompt, n, r)
    runs = {
        "tandem": tandem(path, prompt, n, r),
        "tandem_eager": tandem(path, prompt, n, r, enforce_eager=True),
        "tandem_torch_path": tandem(path, prompt, n, r, cpu_kernels=False),
    }
    hf_after = hf(path, prompt, n, r)  # HF again: drift of a shared machine shows here
    result = {
        "clock": args.clock,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "model": f"random Llama, hidden {args.hidden_size}, {args.num_layers} layers",
        "hf_ms_per_token": [hf_s * 1e3, hf_after * 1e3],
        **{f"{k}_ms_per_token": v * 1e3 for k, v in runs.items()},
        **{f"{k}_speedup_vs_hf": min(hf_s, hf_after) / v for k, v in runs.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
