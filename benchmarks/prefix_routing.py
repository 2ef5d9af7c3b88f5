"""Prefix-aware routing vs least-load vs round-robin on a shared-prefix workload.

The workload has ``--groups`` long shared prefixes (think system prompts or few-shot examples),
each followed by ``--per-group`` distinct suffixes; requests interleave across groups (seeded
shuffle) and run ``--concurrency`` at a time. With several workers, a prefix-aware router keeps
each group on the worker that already caches its prefix: the workers' prefix-cache hit rate rises
and TTFT falls.

Reports, per policy: TTFT p50/p99, end-to-end mean, request throughput, the workers' prefix-cache
hit rate (from ``tandem_prefix_cache_{hit,queried}_tokens_total`` deltas) and the router's
placement decisions. Writes JSON (``--json``) and, if matplotlib is installed, a PNG (``--png``).

    # one run against a running deployment:
    python benchmarks/prefix_routing.py --router-url http://127.0.0.1:8000
    # or let the script run `tandem up` once per policy (real workers):
    python benchmarks/prefix_routing.py --launch --prefill 0 --decode 2 --model demo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

POLICIES = ("prefix-aware", "least-load", "round-robin")


def make_workload(groups: int, per_group: int, prefix_chars: int, suffix_chars: int,
                  seed: int) -> list[str]:  # fmt: skip
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + " "
    prefixes = ["".join(rng.choice(alphabet) for _ in range(prefix_chars)) for _ in range(groups)]
    prompts = [
        p + "".join(rng.choice(alphabet) for _ in range(suffix_chars))
        for p in prefixes
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """Prometheus text at ``url`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10, headers=headers).text
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[tuple[str, tuple], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def worker_cache_counters(router_url: str) -> tuple[float, float]:
    workers = httpx.get(f"{router_url}/internal/workers", timeout=10).json()["workers"]
    hit = queried = 0.0
    for w in workers:
        try:
            s = scrape(f"{w['url']}/metrics")
        except (httpx.HTTPError, ValueError):
            continue  # a worker without metrics counts as no data
        hit += total(s, "tandem_prefix_cache_hit_tokens_total")
        queried += total(s, "tandem_prefix_cache_queried_tokens_total")
    return hit, queried


async def one(c: httpx.AsyncClient, router_url: str, model: str, prompt: str,
              max_tokens: int) -> tuple[float, float]:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    async with c.stream("POST", f"{router_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                ttft = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return ttft if ttft is not None else end, end


async def run_workload(args: argparse.Namespace, router_url: str,
                       headers: dict[str, str]) -> list[tuple[float, float]]:  # fmt: skip
    prompts = make_workload(args.groups, args.per_group, args.prefix_chars, args.suffix_chars,
                            args.seed)  # fmt: skip
    sem = asyncio.Semaphore(args.concurrency)
    results: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=600, headers=headers) as c:

        async def go(p: str) -> None:
            async with sem:
                results.append(await one(c, router_url, args.model, p, args.max_tokens))

        await asyncio.gather(*(go(p) for p in prompts))
    return results


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def measure(args: argparse.Namespace, router_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    hit0, q0 = worker_cache_counters(router_url)
    before = scrape(f"{router_url}/metrics")
    t0 = time.perf_counter()
    res = asyncio.run(run_workload(args, router_url, headers))
    wall = time.perf_counter() - t0
    hit1, q1 = worker_cache_counters(router_url)
    after = scrape(f"{router_url}/metrics")
    placements: dict[str, float] = {}
    for (name, labels), v in after.items():
        if name == "tandem_router_placements_total":
            d = dict(labels)
            key = f"{d['pool']}/{d['reason']}"
            placements[key] = placements.get(key, 0) + v - before.get((name, labels), 0.0)
    ttfts = [r[0] for r in res]
    return {
        "requests": len(res),
        "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 2),
        "ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 2),
        "e2e_mean_ms": round(sum(r[1] for r in res) / len(res) * 1e3, 2),
        "throughput_rps": round(len(res) / wall, 2),
        "prefix_cache_hit_rate": round((hit1 - hit0) / (q1 - q0), 4) if q1 > q0 else None,
        "placements": {k: v for k, v in sorted(placements.items()) if v},
    }


def launch_up(args: argparse.Namespace, policy: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tandem.cli", "up", "--model", args.model, "--port",
            str(args.port), "--prefill", str(args.prefill), "--decode", str(args.decode),
            "--policy", policy, "--kv-transport", args.kv_transport]  # fmt: skip
    if args.api_key:
        argv += ["--api-key", args.api_key]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        sys.stderr.write(line)
        if "Tandem is ready" in line:
            return proc
    raise RuntimeError(f"tandem up exited with {proc.wait()} before it was ready")


def stop_up(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [results[n]["ttft_p50_ms"] for n in names], label="p50")
    axes[0].bar(names, [results[n]["ttft_p99_ms"] for n in names], alpha=0.4, label="p99")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(names, [results[n]["prefix_cache_hit_rate"] or 0 for n in names])
    axes[1].set_ylabel("prefix cache hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--router-url", default=None, help="measure a running router (one policy)")
    p.add_argument("--launch", action="store_true", help="run `tandem up` once per policy")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model", default="demo")
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--kv-transport", default="tcp")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--api-key", default=None)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-chars", type=int, default=160)
    p.add_argument("--suffix-chars", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    if not args.launch and not args.router_url:
        p.error("give --router-url or --launch")
    results: dict[str, dict[str, Any]] = {}
    if args.launch:
        for policy in args.policies.split(","):
            proc = launch_up(args, policy)
            try:
                results[policy] = measure(args, f"http://127.0.0.1:{args.port}")
            finally:
                stop_up(proc)
    else:
        results["as-deployed"] = measure(args, args.router_url.rstrip("/"))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
