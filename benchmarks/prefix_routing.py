"""Prefix-aware vs round-robin routing on a multi-turn chat workload, against a sticky oracle.

Workload: ``--sessions`` chat sessions of ``--turns`` turns. Turn t sends, through
``/v1/chat/completions`` (the model's chat template), the whole history of turns < t (user messages
and the assistant's actual replies) plus a new user message of about ``--user-chars`` characters.
A session's next turn starts only after its previous one finished, as a chat client would, and at
most ``--concurrency`` turns are in flight. Replies have a fixed length: ``max_tokens`` with
``ignore_eos``, greedy. Two seeded schedules:

- open loop (default): sessions arrive at ``--session-rate`` per second (Poisson) and think
  ``--think-s`` seconds (exponential) between turns. Every policy faces the same offered load, so
  TTFT compares like with like. The TTFT gap depends on the load: light load leaves round-robin's
  median request a cheap one (its lucky hits and first turns), overload queues everything. The
  default 0.7 sits near round-robin's capacity on 2 busy CPU cores (its closed-loop req/s divided
  by ``--turns``); scale it with the machine.
- closed loop (``--session-rate 0``): a shuffled order of all turns, the earliest turn whose
  session is idle goes next. The saved prefill shows as throughput and end-to-end latency: the
  next turns take the freed capacity at once, so TTFT stays near saturation for every policy.

Model: by default a random-weight Llama written to a temp dir (``--hidden`` 384, ``--layers`` 6,
GQA, vocab 4096, 2048 context) with the demo's byte-level tokenizer and chat template (one token
per byte): big enough that prefill, not per-token serving overhead, dominates a worker's time on a
CPU. Its output head is zero outside printable ASCII, so greedy replies are ASCII text that
tokenizes back to exactly the generated ids, and the history a client sends back is the history
the worker cached.

Sticky-session oracle: each session pinned to one worker, no eviction. A turn's prompt then hits
the longest common prefix with any earlier turn's computed tokens (its prompt plus its reply less
the last token, whose KV is never computed), in full blocks, leaving at least one prompt token to
compute (the engine's own cap). It is computed from each run's own transcript with the model's
tokenizer, exactly as the router tokenizes.

Per policy (``tandem up --prefill 0 --decode N --policy P``, one deployment per policy, same
workload and seed): the workers' prefix-cache hit rate (deltas of
``tandem_prefix_cache_{hit,queried}_tokens_total``), the same from the responses'
``usage.prompt_tokens_details.cached_tokens``, the oracle rate, TTFT p50/p90 (client side, time to
the first content chunk), throughput and the router's placement reasons. ``--repeats`` runs
each policy on several fresh deployments, alternating the order, and pools the requests (a shared
machine drifts). Prints a table and JSON (``--json`` adds every request's TTFT, cached and oracle
tokens).

    python benchmarks/prefix_routing.py --launch            # random Llama, 2 colocated workers
    TANDEM_CLUSTER_TOKEN=... python benchmarks/prefix_routing.py --router-url
        http://127.0.0.1:8000 --internal-url http://127.0.0.1:8001 --model-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.cluster_token import generate_token

POLICIES = ("prefix-aware", "round-robin")
TARGET_HIT_VS_ORACLE = 0.90
TARGET_TTFT_SPEEDUP = 1.5
FIRST_PRINTABLE, LAST_PRINTABLE = 0x20, 0x7E


# -- workload -------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class WorkloadConfig:
    sessions: int
    turns: int
    user_chars: int
    max_tokens: int
    concurrency: int
    seed: int
    session_rate: float = 0.0  # new sessions per second (Poisson); 0 = closed loop
    think_s: float = 0.0  # mean think time between a session's turns (open loop)


@dataclass(slots=True, frozen=True)
class Workload:
    """``messages[s][t]`` is session s's user message at turn t. ``schedule`` lists session ids,
    each ``turns`` times: its k-th occurrence is that session's turn k (closed loop). Open loop:
    session s starts at ``arrivals[s]`` seconds and waits ``think[s][t]`` before turn t."""

    messages: tuple[tuple[str, ...], ...]
    schedule: tuple[int, ...]
    arrivals: tuple[float, ...]
    think: tuple[tuple[float, ...], ...]


def make_workload(cfg: WorkloadConfig) -> Workload:
    if cfg.sessions < 1 or cfg.turns < 1 or cfg.user_chars < 8:
        raise ValueError("need sessions >= 1, turns >= 1 and user_chars >= 8")
    if cfg.session_rate < 0 or cfg.think_s < 0:
        raise ValueError("session_rate and think_s must be >= 0")
    rng = random.Random(cfg.seed)
    letters = string.ascii_lowercase

    def message() -> str:
        n = rng.randint(cfg.user_chars * 3 // 4, cfg.user_chars * 5 // 4)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
        return " ".join(words)[:n]

    messages = tuple(tuple(message() for _ in range(cfg.turns)) for _ in range(cfg.sessions))
    schedule = [s for s in range(cfg.sessions) for _ in range(cfg.turns)]
    rng.shuffle(schedule)
    # Its own stream: the messages stay the same whatever the arrival settings.
    timing = random.Random(cfg.seed + 1)
    arrivals, clock = [], 0.0
    for _ in range(cfg.sessions):
        arrivals.append(clock)
        clock += timing.expovariate(cfg.session_rate) if cfg.session_rate > 0 else 0.0
    think = tuple(
        tuple(0.0 if t == 0 or cfg.think_s == 0 else timing.expovariate(1 / cfg.think_s)
              for t in range(cfg.turns))
        for _ in range(cfg.sessions)
    )  # fmt: skip
    return Workload(messages, tuple(schedule), tuple(arrivals), think)


@dataclass(slots=True, frozen=True)
class TurnResult:
    session: int
    turn: int
    messages: tuple[tuple[str, str], ...]  # (role, content) sent, ending with this turn's user
    reply: str
    start_s: float  # perf_counter when the request was sent
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: the worker's prefix hit


def chat_body(model: str, messages: tuple[tuple[str, str], ...], max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": r, "content": c} for r, c in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def chat_turn(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[str, float, float, dict[str, Any]]:
    """One streamed chat completion: (reply, ttft, e2e, usage). TTFT = first non-empty content."""
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat completion failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    end = time.perf_counter() - t0
    return "".join(parts), ttft if ttft is not None else end, end, usage


async def run_sessions(
    url: str, model: str, wl: Workload, cfg: WorkloadConfig, headers: dict[str, str]
) -> list[TurnResult]:
    """Closed loop (``session_rate`` 0): dispatch the schedule, the earliest pending turn whose
    session is idle, up to ``concurrency`` in flight. Open loop: each session starts at its arrival
    time and sends each turn a think time after the previous one finished, up to ``concurrency``
    in flight."""
    history: list[list[tuple[str, str]]] = [[] for _ in wl.messages]
    next_turn = [0] * len(wl.messages)
    busy: set[int] = set()
    pending = list(wl.schedule)
    results: list[TurnResult] = []
    errors: list[Exception] = []
    done = asyncio.Condition()

    async def one(client: httpx.AsyncClient, s: int) -> None:
        t = next_turn[s]
        msgs = (*history[s], ("user", wl.messages[s][t]))
        try:
            body = chat_body(model, msgs, cfg.max_tokens)
            start = time.perf_counter()
            reply, ttft, e2e, usage = await chat_turn(client, url, body)
        except Exception as exc:  # noqa: BLE001 - re-raised by the dispatcher
            errors.append(exc)
        else:
            details = usage.get("prompt_tokens_details") or {}
            results.append(
                TurnResult(s, t, msgs, reply, start, ttft, e2e, int(usage.get("prompt_tokens", -1)),
                           int(usage.get("completion_tokens", -1)),
                           int(details.get("cached_tokens", 0)))
            )  # fmt: skip
            history[s] = [*msgs, ("assistant", reply)]
            next_turn[s] = t + 1
        async with done:
            busy.discard(s)
            done.notify_all()

    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(timeout=900, headers=headers, limits=limits) as client:
        if cfg.session_rate > 0:
            slots = asyncio.Semaphore(cfg.concurrency)
            t0 = time.perf_counter()

            async def session(s: int) -> None:
                # Pacing, not synchronization: the workload's own arrival and think times.
                await asyncio.sleep(max(0.0, t0 + wl.arrivals[s] - time.perf_counter()))
                for t in range(len(wl.messages[s])):
                    await asyncio.sleep(wl.think[s][t])
                    if errors:
                        return
                    async with slots:
                        await one(client, s)

            await asyncio.gather(*(session(s) for s in range(len(wl.messages))))
        else:
            tasks: list[asyncio.Task[None]] = []
            while pending and not errors:
                async with done:
                    await done.wait_for(
                        lambda: (
                            bool(errors)
                            or (len(busy) < cfg.concurrency and any(s not in busy for s in pending))
                        )
                    )
                    if errors:
                        break
                    s = next(s for s in pending if s not in busy)
                    pending.remove(s)
                    busy.add(s)
                tasks.append(asyncio.create_task(one(client, s)))
            await asyncio.gather(*tasks)
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: (r.session, r.turn))


# -- oracle ---------------------------------------------------------------------------------------
def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sticky_hit_tokens(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Tokens of ``prompt`` a worker that computed every sequence in ``earlier`` (and evicted
    nothing) serves from its prefix cache: full blocks only, at least one token left to compute."""
    cap = (len(prompt) - 1) // block_size * block_size
    best = max((common_prefix_len(seq, prompt) for seq in earlier), default=0)
    return min(best // block_size * block_size, cap)


@dataclass(slots=True, frozen=True)
class OracleReport:
    prompt_tokens: int
    hit_tokens: int
    prompt_token_mismatches: int  # turns whose tokenized prompt length differs from usage
    reply_roundtrip_failures: int  # replies that do not tokenize back to completion_tokens ids
    per_turn_hits: tuple[int, ...]  # in the order of the results given

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def sticky_oracle(results: list[TurnResult], tokenizer: Any, block_size: int) -> OracleReport:
    """The sticky-session hit rate of this run's own transcript (``results`` sorted by session,
    turn). Tokenizes exactly as the router does: chat template to text, then no special tokens."""
    computed: dict[int, list[list[int]]] = collections.defaultdict(list)
    total = hits = mismatches = roundtrip = 0
    per_turn: list[int] = []
    for r in results:
        text = tokenizer.apply_chat_template(
            [{"role": ro, "content": c} for ro, c in r.messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        reply = list(tokenizer.encode(r.reply, add_special_tokens=False))
        mismatches += len(prompt) != r.prompt_tokens
        roundtrip += len(reply) != r.completion_tokens
        total += len(prompt)
        per_turn.append(sticky_hit_tokens(computed[r.session], prompt, block_size))
        hits += per_turn[-1]
        computed[r.session].append(prompt + reply[:-1])
    return OracleReport(total, hits, mismatches, roundtrip, tuple(per_turn))


# -- metrics --------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text at ``url`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[tuple[str, tuple], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


# The worker-facing listeners need the cluster token: --launch hands `tandem up` a fresh one;
# against a deployment it comes from $TANDEM_CLUSTER_TOKEN.
CLUSTER_AUTH: dict[str, str] = {}


def list_workers(internal_url: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{internal_url}/internal/workers", headers=CLUSTER_AUTH, timeout=10)
    return r.json()["workers"]


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


def warm_workers(workers: list[dict[str, Any]], tokens: int = 512) -> None:
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
        with httpx.stream(
            "POST", f"{w['url']}/v1/internal/generate", json=body, headers=CLUSTER_AUTH,
            timeout=300,
        ) as r:  # fmt: skip
            r.raise_for_status()
            for _ in r.iter_lines():
                pass


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


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
    cfg: WorkloadConfig,
    tokenizer: Any,
    api_key: str | None,
) -> RunRecord:
    """Warm the workers, run the workload once through ``router_url`` and diff the counters."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{router_url}/v1/models", headers=headers, timeout=10).json()
    model = models["data"][0]["id"]
    workers = list_workers(internal_url)
    block_sizes = {
        httpx.get(f"{w['url']}/info", headers=CLUSTER_AUTH, timeout=10).json()["block_size"]
        for w in workers
    }
    if len(block_sizes) != 1:
        raise RuntimeError(f"workers disagree on block_size: {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    warm_workers(workers)
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


# -- deployment -----------------------------------------------------------------------------------
def write_chat_llama(out: Path, hidden: int = 256, layers: int = 4, seed: int = 0) -> Path:
    """A random-weight Llama (GQA with 2 KV heads of dim 64 when hidden >= 256, vocab 4096, 2048
    context) with the demo tokenizer. The output head is zero outside printable ASCII: those logits
    are 0 while the max over 95 random printable rows is positive, so greedy picks printable
    ASCII."""
    import torch
    import transformers

    from tandem.engine.demo.tokenizer_build import build_tokenizer

    if hidden % 64 or layers < 1:
        raise ValueError(f"hidden must be a multiple of 64 and layers >= 1, got {hidden}, {layers}")
    torch.manual_seed(seed)
    heads = hidden // 32 if hidden <= 256 else hidden // 64
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=2048,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        keep = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        keep[FIRST_PRINTABLE : LAST_PRINTABLE + 1] = True
        model.lm_head.weight[~keep] = 0.0
    model.save_pretrained(out)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = cfg.max_position_embeddings  # the demo's 256 does not apply
    tokenizer.save_pretrained(out)
    return out


class UpProcess:
    """A `tandem up` process group; drains its output so it never blocks on a full pipe."""

    def __init__(self, argv: list[str], env: dict[str, str], ready_timeout_s: float) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=50)
        self._ready = threading.Event()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)  # fmt: skip
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("tandem up did not get ready:\n" + "".join(self.tail))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            if "Tandem is ready" in line:
                self._ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def launch_up(args: argparse.Namespace, policy: str) -> UpProcess:
    argv = [sys.executable, "-m", "tandem.cli", "up", "--model", args.model_dir, "--port",
            str(args.port), "--internal-port", str(args.port + 1),
            "--prefill", str(args.prefill), "--decode", str(args.decode),
            "--policy", policy, "--kv-transport", args.kv_transport]  # fmt: skip
    for opt in args.engine_option:
        argv += ["--engine-option", opt]
    env = {**os.environ, "TANDEM_CLUSTER_TOKEN": CLUSTER_AUTH["Authorization"].split()[1]}
    if args.api_key:
        argv += ["--api-key", args.api_key]
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return UpProcess(argv, env, ready_timeout_s=600)


# -- report ---------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.1f} at start"


def table(results: dict[str, dict[str, Any]]) -> str:
    cols = [("policy", "{}"), ("hit rate", "{:.3f}"), ("oracle", "{:.3f}"),
            ("hit/oracle", "{:.3f}"), ("TTFT p50 ms", "{:.1f}"), ("TTFT p90 ms", "{:.1f}"),
            ("e2e mean ms", "{:.1f}"), ("req/s", "{:.2f}"), ("out tok/s", "{:.1f}")]  # fmt: skip
    keys = [None, "hit_rate", "oracle_hit_rate", "hit_vs_oracle", "ttft_p50_ms", "ttft_p90_ms",
            "e2e_mean_ms", "throughput_rps", "output_tok_s"]  # fmt: skip
    rows = [[name] + [fmt.format(r[k] or 0) for (_, fmt), k in zip(cols[1:], keys[1:],
                                                                     strict=True)]
            for name, r in results.items()]  # fmt: skip
    head = [c for c, _ in cols]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [" | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True))
             for row in [head, *rows]]  # fmt: skip
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pa, rr = results.get("prefix-aware"), results.get("round-robin")
    if pa is not None:
        out["hit_vs_oracle"] = pa["hit_vs_oracle"]
        out["hit_target_met"] = (pa["hit_vs_oracle"] or 0) >= TARGET_HIT_VS_ORACLE
    if pa is not None and rr is not None:
        speedup = rr["ttft_p50_ms"] / pa["ttft_p50_ms"]
        out["ttft_p50_speedup_rr_over_pa"] = round(speedup, 3)
        out["ttft_p90_speedup_rr_over_pa"] = round(rr["ttft_p90_ms"] / pa["ttft_p90_ms"], 3)
        out["ttft_target_met"] = speedup >= TARGET_TTFT_SPEEDUP
        out["e2e_mean_speedup_rr_over_pa"] = round(rr["e2e_mean_ms"] / pa["e2e_mean_ms"], 3)
        out["throughput_ratio_pa_over_rr"] = round(pa["throughput_rps"] / rr["throughput_rps"], 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--router-url", default=None, help="measure a running router (one policy)")
    p.add_argument("--internal-url", default=None,
                   help="with --router-url: its internal (registry) listener")  # fmt: skip
    p.add_argument("--launch", action="store_true", help="run `tandem up` once per policy")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model-dir", default=None,
                   help="model directory (default: write a random chat Llama to a temp dir); "
                        "with --router-url, the tokenizer for the oracle")  # fmt: skip
    p.add_argument("--hidden", type=int, default=384, help="random model: hidden size")
    p.add_argument("--layers", type=int, default=6, help="random model: layers")
    p.add_argument("--prefill", type=int, default=0, help="0 = colocated workers")
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--kv-transport", default="tcp")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for every launched process (0 = inherit)",
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--api-key", default=None)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--user-chars", type=int, default=300, help="mean user message length")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16, help="turns in flight at most")
    p.add_argument(
        "--session-rate",
        type=float,
        default=0.7,
        help="open loop: new sessions per second, Poisson (0 = closed loop)",
    )
    p.add_argument(
        "--think-s",
        type=float,
        default=1.0,
        help="open loop: mean think time between a session's turns",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="deployments per policy, alternating the policy order; TTFTs pooled",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not args.launch and not args.router_url:
        p.error("give --router-url or --launch")
    if args.router_url and not args.model_dir:
        p.error("--router-url needs --model-dir (the tokenizer for the oracle)")
    if args.router_url and not (args.internal_url and os.environ.get("TANDEM_CLUSTER_TOKEN")):
        p.error("--router-url needs --internal-url and $TANDEM_CLUSTER_TOKEN (the registry)")
    token = os.environ.get("TANDEM_CLUSTER_TOKEN") or generate_token()
    CLUSTER_AUTH["Authorization"] = f"Bearer {token}"
    if args.model_dir is None:
        out = Path(tempfile.mkdtemp(prefix="tandem-chat-llama-"))
        args.model_dir = str(write_chat_llama(out, args.hidden, args.layers))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    cfg = WorkloadConfig(args.sessions, args.turns, args.user_chars, args.max_tokens,
                         args.concurrency, args.seed, args.session_rate, args.think_s)  # fmt: skip
    env_note = machine()
    runs: dict[str, list[RunRecord]] = collections.defaultdict(list)
    if args.launch:
        policies = args.policies.split(",")
        for rep in range(args.repeats):
            # Alternate the order so slow drift of a shared machine hits every policy alike.
            for policy in policies if rep % 2 == 0 else policies[::-1]:
                print(f"== {policy} (run {rep + 1}/{args.repeats}): starting tandem up",
                      file=sys.stderr, flush=True)  # fmt: skip
                up = launch_up(args, policy)
                try:
                    run = measure(f"http://127.0.0.1:{args.port}",
                                  f"http://127.0.0.1:{args.port + 1}", cfg, tokenizer,
                                  args.api_key)  # fmt: skip
                finally:
                    up.stop()
                runs[policy].append(run)
                one = summarize([run], cfg.turns)
                print(f"== {policy}: hit/oracle {one['hit_vs_oracle']}, TTFT p50 "
                      f"{one['ttft_p50_ms']} ms", file=sys.stderr, flush=True)  # fmt: skip
    else:
        runs["as-deployed"].append(
            measure(
                args.router_url.rstrip("/"),
                args.internal_url.rstrip("/"),
                cfg,
                tokenizer,
                args.api_key,
            )  # fmt: skip
        )
    results = {policy: summarize(rs, cfg.turns) for policy, rs in runs.items()}
    report: dict[str, Any] = {
        "machine": env_note,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "workload": asdict(cfg),
        "deployment": {
            "prefill": args.prefill,
            "decode": args.decode,
            "threads": args.threads,
            "engine_options": args.engine_option,
            "hidden": args.hidden,
            "layers": args.layers,
            "model_dir": args.model_dir,
        },  # fmt: skip
        "results": results,
        "summary": summary(results),
    }
    print(table(results))
    print(json.dumps(report, indent=2))
    if args.json:
        report["turn_fields"] = TURN_FIELDS
        report["turn_logs"] = {p: [turn_log(run) for run in rs] for p, rs in runs.items()}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
