"""The prefix-routing benchmark's command line; ``benchmarks/prefix_routing.py`` calls ``main``."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchlib.launch import Deployment, Placement
from benchlib.machine import machine
from benchlib.model import write_chat_llama

from prefix_bench.measure import TURN_FIELDS, RunRecord, measure, summarize, turn_log
from prefix_bench.report import summary, table
from prefix_bench.workload import WorkloadConfig
from tandem.up import UpConfig

POLICIES = ("prefix-aware", "round-robin")


def launch(args: argparse.Namespace, policy: str) -> Deployment:
    """What ``tandem up --prefill P --decode D --policy POLICY`` runs, with ``--threads`` as every
    process's OMP_NUM_THREADS (0: inherited)."""
    config = UpConfig(
        model=args.model_dir, port=args.port, prefill=args.prefill, decode=args.decode,
        policy=policy, kv_transport=args.kv_transport, api_key=args.api_key,
        engine_options=tuple(args.engine_option),
    )  # fmt: skip
    threads = args.threads or None
    placement = Placement(router_threads=threads,
                          worker_threads=(threads,) * (args.prefill + args.decode))  # fmt: skip
    return Deployment(config, placement)


def main(doc: str | None = None) -> int:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--router-url", default=None, help="measure a running router (one policy)")
    p.add_argument("--internal-url", default=None,
                   help="with --router-url: its internal (registry) listener; the cluster token "
                   "comes from $TANDEM_CLUSTER_TOKEN")  # fmt: skip
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
    p.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
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
                with launch(args, policy) as up:
                    run = measure(up.url, up.internal_url, up.cluster_headers, cfg, tokenizer,
                                  args.api_key)  # fmt: skip
                runs[policy].append(run)
                one = summarize([run], cfg.turns)
                print(f"== {policy}: hit/oracle {one['hit_vs_oracle']}, TTFT p50 "
                      f"{one['ttft_p50_ms']} ms", file=sys.stderr, flush=True)  # fmt: skip
    else:
        cluster = {"Authorization": f"Bearer {os.environ['TANDEM_CLUSTER_TOKEN']}"}
        runs["as-deployed"].append(
            measure(
                args.router_url.rstrip("/"),
                args.internal_url.rstrip("/"),
                cluster,
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
