"""`tandem up`'s worker threads on a machine the router and the client share: ITL and TTFT of
the same Poisson replay with each thread count, in one run.

    python benchmarks/worker_threads.py [--threads 1,2] [--rate 24.5] [--prefill 0]

A parallel step ends in a barrier, so a worker with more threads than the cores it has to itself
waits for whichever thread the OS preempted (for the router, the client or the other worker).
`tandem up` now splits the machine's CPUs less one between its workers; this measures why.
Workload: 64-token prompts, 32 output tokens (the planner validation's demo chat shape).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from replay_load import replay

from tandem.calibrate import LocalUp
from tandem.planner.metrics import Percentiles
from tandem.planner.workload import Arrival, Lengths, Workload, generate

DEMO_TEXT = tuple(range(48, 123))  # printable ASCII ids of the demo tokenizer


def run(threads: int, prefill: int, rate: float, seconds: float, log_dir: Path) -> dict:
    w = Workload(rate=rate, isl=Lengths(64), osl=Lengths(32), num_requests=round(rate * seconds),
                 arrival=Arrival.POISSON)  # fmt: skip
    reqs = generate(w, DEMO_TEXT, 0, 256)
    args = ["--model", "demo", "--prefill", str(prefill), "--decode", "1", "--kv-transport", "tcp",
            "--worker-threads", str(threads)]  # fmt: skip
    with LocalUp(args, prefill + 1, log_dir, f"up-t{threads}") as up:
        replay(up.url, "demo", reqs[:8])  # warm-up
        done = [m for m in replay(up.url, "demo", reqs) if m.error is None]
    itl = Percentiles.of([m.itl for m in done if m.itl is not None])
    ttft = Percentiles.of([m.ttft for m in done if m.ttft is not None])
    return {"threads": threads, "completed": len(done), "of": len(reqs),
            "ttft_p50_ms": ttft.p50 * 1e3, "ttft_p90_ms": ttft.p90 * 1e3,
            "itl_p50_ms": itl.p50 * 1e3, "itl_p90_ms": itl.p90 * 1e3}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rate", type=float, default=24.5, help="requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prefill", type=int, default=0, help="prefill workers (0: colocated)")
    a = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="worker-threads-"))
    rows = [run(int(t), a.prefill, a.rate, a.seconds, log_dir) for t in a.threads.split(",")]
    base = rows[0]
    for r in rows:
        r["itl_p50_vs_first"] = r["itl_p50_ms"] / base["itl_p50_ms"]
    print(json.dumps({"rate": a.rate, "prefill": a.prefill, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
