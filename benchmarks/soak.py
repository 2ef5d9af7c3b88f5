"""Soak: a long run of mixed traffic against a real ``tandem up --prefill 1 --decode 2`` while
workers are killed, stopped and restarted, then an overload phase at 5x capacity with mixed
priorities; the row of docs/reliability.md's table.

    python benchmarks/soak.py --requests 2000 --concurrency 16

Uses the chaos suite's harness (tests/chaos/chaos_lib.py: one definition of the load driver and
of the end-of-run checks). Phases:

1. warm-up (mixed traffic), then every worker's RSS is recorded;
2. ``--requests`` requests of mixed shapes (chat and completions, stream or not, ``n``, stop
   strings, logprobs, greedy or seeded, 10 % abandoned by the client at a random moment) while a
   fault lands every ``--fault-every`` seconds, in turn: kill -9 of decode-0, SIGSTOP of decode-1
   past the heartbeat expiry, kill -9 of prefill-0, a disconnect storm (half of 40 streams
   dropped);
3. overload: 5x the in-flight limit at once, one in five at high priority;
4. idle: every worker's accounting (``/v1/internal/integrity``) and RSS.

Reported: requests sent / completed / errored (an OpenAI error object or a stream error event) /
abandoned by the client / hung (no end within the deadline), blocks held by idle workers, RSS
drift of workers never restarted, TTFT p99 of high-priority requests under overload and the
share of low-priority ones shed, restarts and migrations. ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS / "chaos"), str(_TESTS)]  # chaos_lib, and procs (the cluster token)

from chaos_lib import (  # noqa: E402 - the harness lives with the chaos suite
    Cluster,
    Outcome,
    Spec,
    mixed_specs,
    run_load,
    summary,
)

from tandem.engine.demo import sample_inputs  # noqa: E402

INFLIGHT = 16


def faults(c: Cluster, every_s: float, stop: threading.Event, log: list[str]) -> None:
    """Inject one fault every ``every_s`` seconds until ``stop``; each waits for the cluster to
    be whole again (tandem up restarts what was killed) before the next."""
    plan = ["kill decode-0", "stop decode-1", "kill prefill-0", "storm"]
    i = 0
    while not stop.wait(every_s):
        what = plan[i % len(plan)]
        i += 1
        log.append(f"{time.strftime('%H:%M:%S')} {what}")
        kind, _, name = what.partition(" ")
        if kind == "kill":
            c.signal(name, signal.SIGKILL)
        elif kind == "stop":
            c.signal(name, signal.SIGSTOP)
            time.sleep(5.0)  # past the router's 3 s heartbeat expiry
            c.signal(name, signal.SIGCONT)
        else:
            storm = [Spec(w, temperature=1.0, seed=k, max_tokens=64, ignore_eos=True,
                          drop_after_chunks=random.randint(1, 12) if k % 2 else None)
                     for k, w in enumerate(sample_inputs(40, seed=i))]  # fmt: skip
            run_load(c.url, storm, INFLIGHT)
        try:
            c.wait_registered(3, timeout=120)
        except TimeoutError:
            log.append("cluster not whole again after 120 s")


def overload(c: Cluster) -> dict[str, float]:
    specs = [Spec(w, max_tokens=24, priority=(0 if k % 5 == 0 else 10))
             for k, w in enumerate(sample_inputs(5 * INFLIGHT, seed=77))]  # fmt: skip
    outs = run_load(c.url, specs, concurrency=len(specs))
    high = sorted(o.ttft_s or float("inf") for o in outs if o.spec.priority == 0)
    low = [o for o in outs if o.spec.priority == 10]
    return {
        "high_ok": sum(1 for o in outs if o.spec.priority == 0 and o.kind == "ok") / len(high),
        "high_ttft_p99_s": high[min(len(high) - 1, int(0.99 * len(high)))],
        "low_shed_share": sum(1 for o in low if o.status == 429) / len(low),
        "hung": sum(1 for o in outs if o.kind == "hung"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=INFLIGHT)
    ap.add_argument("--fault-every", type=float, default=20.0, metavar="SECONDS")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--kv-transport", choices=("ucx", "tcp"), default="ucx")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    c = Cluster(
        log_dir, "--prefill", "1", "--decode", "2", "--kv-transport", a.kv_transport,
        "--max-inflight-requests", str(INFLIGHT), "--max-queued-requests", str(INFLIGHT),
        "--queue-timeout", "30", "--request-timeout", "120", "--engine-option", "num_blocks=512",
    )  # fmt: skip
    fault_log: list[str] = []
    try:
        c.wait_ready()
        run_load(c.url, mixed_specs(200, rng, abort_fraction=0.0), a.concurrency)
        rss_warm = c.rss()
        pids_warm = dict(c.pids)
        stop = threading.Event()
        injector = threading.Thread(target=faults, args=(c, a.fault_every, stop, fault_log))
        if not a.no_faults:
            injector.start()
        started = time.monotonic()
        outcomes: list[Outcome] = run_load(
            c.url, mixed_specs(a.requests, rng), a.concurrency, deadline_s=150.0
        )
        elapsed = time.monotonic() - started
        stop.set()
        if injector.is_alive():
            injector.join(180)
        c.wait_registered(3, timeout=120)
        load = overload(c)
        try:
            c.assert_clean(outcomes, timeout=60)
            clean = True
        except AssertionError as exc:
            print(f"NOT CLEAN: {exc}", file=sys.stderr)
            clean = False
        reports = [c.integrity(u) for u in c.worker_urls()]
        rss_end = c.rss()
        steady = [n for n in rss_warm if c.pids.get(n) == pids_warm[n]]
        drift = {n: rss_end[n] / rss_warm[n] - 1.0 for n in steady}
        kinds = summary(outcomes)
        result = {
            "requests": a.requests,
            "seconds": round(elapsed, 1),
            "completed": kinds.get("ok", 0),
            "errored": kinds.get("error", 0) + kinds.get("stream_error", 0),
            "abandoned": kinds.get("dropped", 0),
            "hung": kinds.get("hung", 0) + load["hung"],
            "errors_by_code": dict(
                sorted(
                    (k, sum(1 for o in outcomes if (o.error or {}).get("code") == k))
                    for k in {(o.error or {}).get("code") for o in outcomes if o.error}
                )
            ),
            "blocks_leaked": sum(r["blocks_in_use"] for r in reports),
            "accounting_ok": all(r["ok"] for r in reports) and clean,
            "rss_drift_pct": {n: round(100 * d, 2) for n, d in drift.items()},
            "restarts": {n: c.restarts(n) for n in c.pids if n != "router"},
            "migrations": c.router_metric("tandem_router_migrations_total"),
            "overload": load,
            "faults": fault_log,
        }
    finally:
        c.stop()
    print(json.dumps(result, indent=2))
    worst = max(result["rss_drift_pct"].values(), default=0.0)
    print(
        f"\n| {a.requests} | {result['completed']} | {result['errored']} | {result['abandoned']}"
        f" | {result['hung']} | {result['blocks_leaked']} | {worst:+.1f} %"
        f" | {1000 * load['high_ttft_p99_s']:.0f} ms | {100 * load['low_shed_share']:.0f} %"
        f" | {sum(result['restarts'].values())} | {result['migrations']:.0f} |"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=2))
    return 0 if result["hung"] == 0 and result["blocks_leaked"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
