"""Prefix pull from a peer vs recomputing the prefix, as a function of the prefix length.

Two colocated engines with the peer-pull role (``decode/peer.py``, a real connector over TCP or
UCX) in one process: the source has computed a prompt; the puller then serves the same prompt
(prefix + ``--suffix`` new tokens, one output token) either by recomputing it all or by pulling
the prefix's blocks from the source (the grant, the pull with its checksum check, then the
suffix). Reported per prefix length: time to first token of each (median of ``--reps``, the order
alternating), their ratio, and the crossover (the shortest length from which the pull always
wins): ``tandem up``'s ``--peer-pull-min-tokens`` default comes from it. The two engines share
this machine's cores, so a pull here also pays for the source's side of it; across two machines
it can only be cheaper.

    python benchmarks/peer_pull.py                                  # demo + a larger random Llama
    python benchmarks/peer_pull.py --models demo --reps 1 --lengths 32,128   # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

DEFAULT_LENGTHS = {
    "demo": [16, 32, 64, 96, 128, 192, 224],
    "large": [16, 32, 64, 128, 256, 512, 1024, 1536],
}


def build_peer(model: str, transport: str, num_blocks: int) -> Any:
    from prometheus_client import CollectorRegistry

    from tandem.decode.peer import PeerColocatedRole
    from tandem.engine.builder import build_engine_parts
    from tandem.engine.engine import Engine
    from tandem.engine.llm import build_engine_config
    from tandem.engine.worker.role import RoleContext

    parts = build_engine_parts(build_engine_config(model, num_blocks=num_blocks))
    role = PeerColocatedRole(transport, kv_lease_seconds=10.0, kv_transfer_timeout=30.0)
    ctx = RoleContext("peer", "127.0.0.1", None, CollectorRegistry(), "bench")
    return role, Engine(parts, role.attach(parts, ctx))


def run(engines: list[Any], rid: str) -> None:
    """Step every engine until ``rid`` has finished and nothing is pinned any more."""
    deadline = time.monotonic() + 300
    done = False
    while not done or any(e.scheduler.pinned or e.has_unfinished for e in engines):
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            for out in e.step():
                assert out.error is None, out.error
                done |= out.request_id == rid and out.finished


def serve(engine: Any, role: Any, rid: str, prompt: list[int], **fields: Any) -> None:
    from tandem.engine.worker.protocol import parse_generate_request
    from tandem.engine.worker.service import submit

    sampling = {"temperature": 0.0, "max_tokens": 1, "ignore_eos": True}
    body = {"request_id": rid, "prompt_token_ids": prompt, "sampling_params": sampling, **fields}
    submit(engine, role, parse_generate_request(body))


def measure(model: str, label: str, lengths: list[int], args: argparse.Namespace) -> dict:
    bs = 16
    num_blocks = 2 * ((max(lengths) + args.suffix) // bs + 2) + 8
    src_role, src = build_peer(model, args.transport, num_blocks)
    dst_role, dst = build_peer(model, args.transport, num_blocks)
    vocab = min(src.arch.vocab_size, 256)
    rng = random.Random(args.seed)
    rows = []
    try:
        for n, length in enumerate(lengths):
            times: dict[str, list[float]] = {"recompute": [], "pull": []}
            for rep in range(args.reps + 1):  # the first is a warm-up
                prompt = [rng.randrange(vocab) for _ in range(length + args.suffix)]
                serve(src, src_role, f"w{n}-{rep}", prompt)
                run([src], f"w{n}-{rep}")
                order = ("recompute", "pull") if rep % 2 == 0 else ("pull", "recompute")
                for mode in order:
                    assert dst.pool.reset_prefix_cache()  # nothing of it cached on the puller
                    rid = f"{mode}{n}-{rep}"
                    t0 = time.perf_counter()
                    if mode == "pull":
                        params = src_role.grant(src, f"g{rid}", prompt[:length])
                        assert params is not None and len(params["block_ids"]) == length // bs
                        serve(dst, dst_role, rid, prompt, kv_prefix_params=params)
                    else:
                        serve(dst, dst_role, rid, prompt)
                    run([dst, src], rid)
                    if rep > 0:
                        times[mode].append(time.perf_counter() - t0)
                assert src.pool.reset_prefix_cache()
            rec, pull = (statistics.median(times[m]) * 1e3 for m in ("recompute", "pull"))
            rows.append({"prefix_tokens": length, "recompute_ms": round(rec, 2),
                         "pull_ms": round(pull, 2), "speedup": round(rec / pull, 2)})  # fmt: skip
            print(f"{label:6} {length:6d} tokens  recompute {rec:8.2f} ms  pull {pull:8.2f} ms"
                  f"  x{rec / pull:5.2f}", flush=True)  # fmt: skip
    finally:
        src_role.close()
        dst_role.close()
    crossover = None
    for i, row in enumerate(rows):
        if all(r["pull_ms"] < r["recompute_ms"] for r in rows[i:]):
            crossover = row["prefix_tokens"]
            break
    return {"model": label, "transport": args.transport, "rows": rows, "crossover": crossover}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        x = [r["prefix_tokens"] for r in res["rows"]]
        ax.plot(x, [r["recompute_ms"] for r in res["rows"]], "o-", label="recompute")
        ax.plot(x, [r["pull_ms"] for r in res["rows"]], "s-", label=f"pull ({res['transport']})")
        ax.set(title=res["model"], xlabel="prefix tokens", ylabel="time to first token (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,large", help="demo and/or large (a random Llama)")
    ap.add_argument("--transport", choices=("tcp", "ucx"), default="tcp")
    ap.add_argument("--lengths", default=None, help="prefix lengths in tokens (multiples of 16)")
    ap.add_argument("--suffix", type=int, default=8, help="prompt tokens after the prefix")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="peer_pull_") as tmp:
        for label in args.models.split(","):
            model = "demo"
            if label == "large":
                from benchlib.model import write_chat_llama

                model = str(write_chat_llama(Path(tmp) / "large", args.hidden, args.layers))
            lengths = (
                [int(x) for x in args.lengths.split(",")] if args.lengths
                else DEFAULT_LENGTHS[label]
            )  # fmt: skip
            results.append(measure(model, label, lengths, args))
    for res in results:
        x = res["crossover"]
        where = f"from {x} prefix tokens on" if x is not None else "nowhere in this sweep"
        print(f"{res['model']} ({res['transport']}): the pull beats recomputing {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
