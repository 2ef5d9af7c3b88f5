"""Host KV tier off vs on: multi-turn sessions whose KV outgrows the device pool (offline engine).

Workload: ``--sessions`` sessions of ``--turns`` turns. Turn t's prompt is the session's whole
history (every earlier prompt and the engine's actual reply) plus a new user message of about
``--user-tokens`` random tokens; replies are ``--reply-tokens`` long (greedy, EOS ignored). A
session's next turn starts only after its previous one finished. Open loop (default): sessions
arrive at ``--session-rate`` per second (Poisson) and think ``--think-s`` seconds (exponential)
between turns, so every mode faces the same offered load; ``--session-rate 0`` is closed loop with
at most ``--concurrency`` turns in flight. The device pool (``--num-blocks``) holds a fraction of
the workload's KV; the tier (``--offload-mib``, default: room for all of it) keeps what the pool
evicts. A ``--no-reuse`` run sends every turn with a fresh history: the tier's pure overhead.

Each mode (``off``: device pool only; ``on``: plus the host tier; ``--with-unbounded``: a device
pool holding everything, the ceiling) runs on a fresh engine in the same process, ``--repeats``
times alternating. Reported per mode: TTFT p50/p90 (from when a turn was due to its first token,
the engine driven in-process, no HTTP), prefix-cache hit rate (hit / queried prompt tokens) and
the share served from the host tier, output tokens/s, preemptions, and the on/off ratios.

    python benchmarks/kv_tier.py                               # random Llama, hidden 384
    python benchmarks/kv_tier.py --sessions 4 --turns 3 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("off", "on")


@dataclass(slots=True, frozen=True)
class Workload:
    messages: tuple[tuple[tuple[int, ...], ...], ...]  # [session][turn] user tokens
    arrivals: tuple[float, ...]
    think: tuple[tuple[float, ...], ...]


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    u = args.user_tokens

    def message() -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(rng.randint(u * 3 // 4, u * 5 // 4)))

    msgs = tuple(tuple(message() for _ in range(args.turns)) for _ in range(args.sessions))
    timing = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in range(args.sessions):
        arrivals.append(t)
        if args.session_rate > 0:
            t += timing.expovariate(args.session_rate)
    think = tuple(
        tuple(timing.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in msgs[0])
        for _ in msgs
    )
    return Workload(msgs, tuple(arrivals), think)


@dataclass(slots=True)
class RunResult:
    mode: str
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    output_tokens: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    preemptions: int = 0
    swaps: int = 0


def run(model: str, options: dict[str, Any], wl: Workload, args: argparse.Namespace) -> RunResult:
    """Drive one fresh engine through the workload; the driver owns the clock."""
    from tandem import LLM, SamplingParams

    engine = LLM(model, **options).engine
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    engine.add_request("warmup", list(wl.messages[0][0]), params)
    while engine.has_unfinished:
        engine.step()
    before = engine.stats()
    history: list[list[int]] = [[] for _ in wl.messages]
    turn = [0] * len(wl.messages)
    due: list[tuple[float, int]] = [(a, s) for s, a in enumerate(wl.arrivals)]
    heapq.heapify(due)
    live: dict[str, tuple[int, float, list[int], list[int]]] = {}  # rid -> session, due, prompt
    res = RunResult("")
    start = time.monotonic()
    while due or live:
        now = time.monotonic() - start
        while due and due[0][0] <= now and (args.session_rate > 0 or len(live) < args.concurrency):
            at, s = heapq.heappop(due)
            fresh = [] if args.no_reuse else history[s]
            prompt = fresh + list(wl.messages[s][turn[s]])
            rid = f"s{s}t{turn[s]}"
            engine.add_request(rid, prompt, params, arrival_time=start + at)
            live[rid] = (s, at, prompt, [])
        if not live:
            time.sleep(max(0.0, min(0.05, due[0][0] - now)))
            continue
        for out in engine.step():
            s, at, prompt, reply = live[out.request_id]
            if not reply and out.new_token_ids:
                res.ttft_s.append(time.monotonic() - start - at)
            reply.extend(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                res.output_tokens += len(reply)
                history[s] = prompt + reply
                turn[s] += 1
                if turn[s] < len(wl.messages[s]):
                    done = time.monotonic() - start
                    heapq.heappush(due, (done + wl.think[s][turn[s]], s))
    res.wall_s = time.monotonic() - start
    after = engine.stats()
    res.queried_tokens = after.prefix_queried_tokens - before.prefix_queried_tokens
    res.hit_tokens = after.prefix_hit_tokens - before.prefix_hit_tokens
    res.preemptions = after.num_preemptions - before.num_preemptions
    res.swaps = after.num_swap_preemptions - before.num_swap_preemptions
    if after.host_tier is not None and before.host_tier is not None:
        res.host_hit_tokens = after.host_tier.hit_tokens - before.host_tier.hit_tokens
    engine.check_integrity()
    return res


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    ttft = [t for r in runs for t in r.ttft_s]
    queried = sum(r.queried_tokens for r in runs)
    return {
        "turns": len(ttft),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "hit_rate": sum(r.hit_tokens for r in runs) / queried if queried else 0.0,
        "host_hit_share": sum(r.host_hit_tokens for r in runs) / queried if queried else 0.0,
        "output_tok_s": sum(r.output_tokens for r in runs) / sum(r.wall_s for r in runs),
        "preemptions": sum(r.preemptions for r in runs),
        "swap_preemptions": sum(r.swaps for r in runs),
    }


def workload_blocks(wl: Workload, reply: int, block: int, no_reuse: bool) -> int:
    """Blocks a pool that never evicts would hold: every session's final context (or, without
    reuse, every turn's own)."""
    if no_reuse:
        return sum(-(-(len(m) + reply) // block) for turns in wl.messages for m in turns)
    return sum(-(-sum(len(m) + reply for m in turns) // block) for turns in wl.messages)


def plot(results: dict[str, dict[str, Any]], runs: dict[str, list[RunResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, rs in runs.items():
        ttft = sorted(t for r in rs for t in r.ttft_s)
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        label = f"{mode}: hit {results[mode]['hit_rate']:.0%}"
        ax.step(ttft, ys, where="post", label=label)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of turns")
    ax.set_title("Host KV tier off vs on (multi-turn, small device pool)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: a random Llama)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=120)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--session-rate", type=float, default=0.5)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=4, help="closed loop only")
    ap.add_argument("--num-blocks", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--offload-mib", type=float, default=None)
    ap.add_argument("--no-reuse", action="store_true")
    ap.add_argument("--with-unbounded", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write a TTFT CDF (PNG) here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = args.model
    if model is None:
        from offline_throughput import write_random_llama

        model = write_random_llama(args.hidden, args.layers)
    from tandem.engine.builder import build_engine_parts
    from tandem.engine.llm import build_engine_config

    base = {"num_blocks": args.num_blocks, "max_model_len": args.max_model_len}
    probe = build_engine_parts(build_engine_config(model, **base))
    wl = make_workload(args, probe.arch.vocab_size)
    need = workload_blocks(wl, args.reply_tokens, probe.layout.block_size, args.no_reuse)
    block_bytes = probe.layout.block_bytes
    del probe
    offload = int(args.offload_mib * 2**20) if args.offload_mib else (need + 64) * block_bytes
    options = {
        "off": base,
        "on": {**base, "kv_offload_bytes": offload},
        "unbounded": {**base, "num_blocks": max(args.num_blocks, need + 64)},
    }
    modes = [*MODES, "unbounded"] if args.with_unbounded else list(MODES)
    runs: dict[str, list[RunResult]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            r = run(model, options[mode], wl, args)
            r.mode = mode
            runs[mode].append(r)
    results = {m: summarize(rs) for m, rs in runs.items()}
    off, on = results["off"], results["on"]
    ratios = {
        "ttft_p50_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p90_off_over_on": off["ttft_p90_s"] / on["ttft_p90_s"],
        "throughput_on_over_off": on["output_tok_s"] / off["output_tok_s"],
    }
    print(f"workload KV: {need} blocks; device pool {args.num_blocks}; tier {offload >> 20} MiB")
    print(f"{'mode':<10} {'TTFT p50':>9} {'TTFT p90':>9} {'hit':>6} {'host':>6} {'tok/s':>8} "
          f"{'preempt':>8} {'swap':>5}")  # fmt: skip
    for m, s in results.items():
        print(
            f"{m:<10} {s['ttft_p50_s']:>9.3f} {s['ttft_p90_s']:>9.3f} {s['hit_rate']:>6.1%} "
            f"{s['host_hit_share']:>6.1%} {s['output_tok_s']:>8.1f} {s['preemptions']:>8} "
            f"{s['swap_preemptions']:>5}"
        )
    print("ratios:", {k: round(v, 3) for k, v in ratios.items()})
    if args.plot:
        plot(results, runs, args.plot)
    if args.json:
        out = {"args": vars(args), "results": results, "ratios": ratios}
        out["runs"] = {m: [asdict(r) for r in rs] for m, rs in runs.items()}
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
