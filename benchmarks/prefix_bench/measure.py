"""One measurement of the multi-turn workload on a deployment, and the per-policy summary."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
from benchlib.machine import pct
from benchlib.metrics import list_workers, scrape, total
from benchlib.model import FIRST_PRINTABLE, LAST_PRINTABLE

from prefix_bench.oracle import OracleReport, sticky_oracle
from prefix_bench.workload import TurnResult, WorkloadConfig, make_workload, run_sessions


def worker_cache_counters(workers: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{engine_id: (hit tokens, queried tokens)}; raises if a worker has no metrics (the rate
    would silently cover part of the pool)."""
    out = {}
    for w in workers:
        s = scrape(f"{w['url']}/metrics")
        out[w["engine_id"]] = (
            total(s, "tandem_prefix_cache_hit_tokens_total"),
            total(s, "tandem_prefix_cache_queried_tokens_total"),
        )
    return out


def warm_workers(workers: list[dict[str, Any]], cluster: dict[str, str], tokens: int = 512) -> None:
    """One request straight to each worker (internal API) so first-forward costs are not timed.
    Plain bytes without BOS: the prompt shares no block with the workload."""
    rng = random.Random(12345)
    for i, w in enumerate(workers):
        body = {
            "request_id": f"prefix-bench-warmup-{i}-{time.time_ns()}",
            "prompt_token_ids": [
                rng.randrange(FIRST_PRINTABLE, LAST_PRINTABLE) for _ in range(tokens)
            ],
            "sampling_params": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
            "kv_transfer_params": None,
            "remote_decode": False,
        }
        url = f"{w['url']}/v1/internal/generate"
        with httpx.stream("POST", url, json=body, headers=cluster, timeout=300) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass


@dataclass(slots=True, frozen=True)
class RunRecord:
    """One policy's measurement on one deployment."""

    results: list[TurnResult]
    oracle: OracleReport
    wall_s: float
    hit_tokens: float
    queried_tokens: float
    placements: dict[str, float]
    per_worker: dict[str, dict[str, int]]


def measure(
    router_url: str,
    internal_url: str,
    cluster: dict[str, str],
    cfg: WorkloadConfig,
    tokenizer: Any,
    api_key: str | None,
) -> RunRecord:
    """Warm the workers, run the workload once through ``router_url`` and diff the counters.
    ``internal_url`` is the router's registry listener; ``cluster`` the cluster-token headers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{router_url}/v1/models", headers=headers, timeout=10).json()
    model = models["data"][0]["id"]
    workers = list_workers(internal_url, cluster)
    block_sizes = {
        httpx.get(f"{w['url']}/info", headers=cluster, timeout=10).json()["block_size"]
        for w in workers
    }
    if len(block_sizes) != 1:
        raise RuntimeError(f"workers disagree on block_size: {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    warm_workers(workers, cluster)
    before_w = worker_cache_counters(workers)
    before_r = scrape(f"{router_url}/metrics")
    t0 = time.perf_counter()
    results = asyncio.run(run_sessions(router_url, model, make_workload(cfg), cfg, headers))
    wall = time.perf_counter() - t0
    after_w = worker_cache_counters(workers)
    after_r = scrape(f"{router_url}/metrics")

    placements: dict[str, float] = {}
    for (name, labels), v in after_r.items():
        if name == "tandem_router_placements_total":
            d = dict(labels)
            key = f"{d['pool']}/{d['reason']}"
            placements[key] = placements.get(key, 0) + v - before_r.get((name, labels), 0.0)
    delta = {e: (after_w[e][0] - before_w[e][0], after_w[e][1] - before_w[e][1]) for e in after_w}
    per_worker = {
        e[:8]: {"queried_tokens": int(q), "computed_tokens": int(q - h)}
        for e, (h, q) in sorted(delta.items())
    }
    return RunRecord(
        results=results,
        oracle=sticky_oracle(results, tokenizer, block_size),
        wall_s=wall,
        hit_tokens=sum(h for h, _ in delta.values()),
        queried_tokens=sum(q for _, q in delta.values()),
        placements=placements,
        per_worker=per_worker,
    )


def summarize(runs: list[RunRecord], turns: int) -> dict[str, Any]:
    """One policy's numbers over its runs: TTFTs pooled, token counters summed, wall times added."""
    results = [r for run in runs for r in run.results]
    ttfts = [r.ttft_s for r in results]
    wall = sum(run.wall_s for run in runs)
    hit = sum(run.hit_tokens for run in runs)
    queried = sum(run.queried_tokens for run in runs)
    oracle_hit = sum(run.oracle.hit_tokens for run in runs)
    oracle_prompt = sum(run.oracle.prompt_tokens for run in runs)
    hit_rate = hit / queried if queried else 0.0
    oracle_rate = oracle_hit / oracle_prompt if oracle_prompt else 0.0
    prompt_total = sum(r.prompt_tokens for r in results)
    placements: dict[str, int] = {}
    for run in runs:
        for k, v in run.placements.items():
            placements[k] = placements.get(k, 0) + int(v)
    return {
        "runs": len(runs),
        "requests": len(results),
        "wall_s": round(wall, 2),
        "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 1),
        "ttft_p90_ms": round(pct(ttfts, 90) * 1e3, 1),
        "ttft_p50_ms_by_turn": {
            t: round(statistics.median(r.ttft_s for r in results if r.turn == t) * 1e3, 1)
            for t in range(turns)
        },
        "ttft_p50_ms_per_run": [
            round(pct([r.ttft_s for r in run.results], 50) * 1e3, 1) for run in runs
        ],
        "e2e_mean_ms": round(statistics.fmean(r.e2e_s for r in results) * 1e3, 1),
        "throughput_rps": round(len(results) / wall, 3),
        "output_tok_s": round(sum(r.completion_tokens for r in results) / wall, 1),
        "prompt_tokens": prompt_total,
        "hit_rate": round(hit_rate, 4),
        "hit_tokens": int(hit),
        "queried_tokens": int(queried),
        "usage_hit_rate": round(sum(r.cached_tokens for r in results) / prompt_total, 4),
        "oracle_hit_rate": round(oracle_rate, 4),
        "oracle_hit_tokens": oracle_hit,
        "hit_vs_oracle": round(hit_rate / oracle_rate, 4) if oracle_rate else None,
        "oracle_prompt_token_mismatches": sum(run.oracle.prompt_token_mismatches for run in runs),
        "reply_roundtrip_failures": sum(run.oracle.reply_roundtrip_failures for run in runs),
        "placements": dict(sorted(placements.items())),
        "per_worker_per_run": [run.per_worker for run in runs],
    }


def turn_log(run: RunRecord) -> list[list[Any]]:
    """Per request, in start order: TURN_FIELDS."""
    t_first = min(r.start_s for r in run.results)
    rows = [
        [r.session, r.turn, round((r.start_s - t_first) * 1e3), round(r.ttft_s * 1e3, 1),
         r.prompt_tokens, r.cached_tokens, o]
        for r, o in zip(run.results, run.oracle.per_turn_hits, strict=True)
    ]  # fmt: skip
    return sorted(rows, key=lambda row: row[2])


TURN_FIELDS = ("session", "turn", "start_ms", "ttft_ms", "prompt_tokens", "cached_tokens",
               "oracle_cached_tokens")  # fmt: skip
