"""Simulated workers at scale: `tandem up --simulate P --prefill 8 --decode 24` on one machine.

Measures what a simulated fleet costs (start-up time to every worker registered, memory per
process as PSS from /proc, shared pages counted once) and checks that it behaves: a replayed
multi-tenant workload with shared prefixes (``replay_load.py``) runs through the real router,
and the prefix-aware router's hit rate (workers' ``tandem_prefix_cache_hit_tokens_total`` over
``..._queried_tokens_total``) is compared with the planner's simulation of the same requests on
the same deployment; the operator's autoscaler (its direct metrics source and pure ``decide``,
as the operator runs them) is fed the fleet's live metrics and its decisions are printed.

    python benchmarks/sim_scale.py --profile profile.json              # 8P24D, ~3 minutes
    python benchmarks/sim_scale.py --profile profile.json --prefill 2 --decode 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
from replay_load import replay

from tandem.calibrate import LocalUp
from tandem.engine.sim.profile import load_profile
from tandem.operator.autoscaler import Pool, PoolMemory, PoolState, decide
from tandem.operator.promtext import Snapshot
from tandem.operator.scaling import policies
from tandem.operator.signals import DirectSource, PodInfo
from tandem.operator.spec import parse_spec
from tandem.planner.metrics import Percentiles
from tandem.planner.simulator import Deployment, SimOptions, run_simulation
from tandem.planner.workload import Lengths, Workload, generate


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def metric_total(text: str, name: str) -> float:
    return Snapshot.parse(text).total(name, lambda _labels: True)


async def autoscaler_decisions(workers: list[dict], router_port: int, ttft: float, itl: float):
    """Two scrapes of the live fleet, as the operator's direct source takes them, then decide."""
    pods = [PodInfo("router-0", "router", "127.0.0.1", router_port, True, 3600.0)]
    for i, w in enumerate(workers):
        port = int(w["url"].rsplit(":", 1)[1])
        pods.append(PodInfo(f"{w['role']}-{i}", w["role"], "127.0.0.1", port, True, 3600.0))
    spec = parse_spec({"autoscaling": {"enabled": True, "ttftSeconds": ttft, "itlSeconds": itl,
                                       "prefill": {"maxReplicas": 64},
                                       "decode": {"maxReplicas": 64}}})  # fmt: skip
    source = DirectSource(warmup_seconds=0)
    async with aiohttp.ClientSession() as session:
        await source.collect(session, pods, time.time())
        await asyncio.sleep(5)
        signals = await source.collect(session, pods, time.time())
    counts = {Pool.PREFILL: sum(w["role"] == "prefill" for w in workers),
              Pool.DECODE: sum(w["role"] == "decode" for w in workers)}  # fmt: skip
    pols = policies(spec)
    return {
        pool.label: decide(pool, PoolState(n, n), signals[pool], PoolMemory(), pols[pool],
                           time.time()).message(pols[pool])
        for pool, n in counts.items()
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--prefix-groups", type=int, default=16, help="tenants sharing a prefix")
    ap.add_argument("--ttft", type=float, default=0.5, help="autoscaler TTFT target (s)")
    ap.add_argument("--itl", type=float, default=0.05, help="autoscaler ITL target (s)")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    max_len = profile.model.max_model_len
    isl = min(192, max_len * 3 // 4)
    w = Workload(rate=args.rate, isl=Lengths(isl, 0.2), osl=Lengths(16, 0.25),
                 num_requests=args.requests, prefix_share=0.6,
                 prefix_groups=args.prefix_groups)  # fmt: skip
    reqs = generate(w, profile.model.sim_token_ids, 0, max_len)
    log_dir = Path(tempfile.mkdtemp(prefix="sim-scale-"))
    n = args.prefill + args.decode
    up = LocalUp(["--simulate", args.profile, "--prefill", str(args.prefill),
                  "--decode", str(args.decode), "--kv-transport", "tcp"], n, log_dir)  # fmt: skip
    t0 = time.monotonic()
    with up:
        startup = time.monotonic() - t0
        workers = up.workers()
        procs = children(up.proc.pid)
        mem = sorted(pss_mb(p) for p in procs)
        print(f"{n} simulated workers + router registered in {startup:.1f} s; PSS per process "
              f"median {mem[len(mem) // 2]:.0f} MB, max {mem[-1]:.0f} MB, total "
              f"{sum(mem) / 1024:.2f} GB ({len(procs)} processes)", flush=True)  # fmt: skip
        measured = replay(up.url, profile.model.name, reqs)
        failed = sum(m.error is not None for m in measured)
        texts = [httpx.get(f"{x['url']}/metrics", timeout=5).text for x in workers]
        hit = sum(metric_total(t, "tandem_prefix_cache_hit_tokens_total") for t in texts)
        queried = sum(metric_total(t, "tandem_prefix_cache_queried_tokens_total") for t in texts)
        router_port = int(up.url.rsplit(":", 1)[1])
        decisions = asyncio.run(autoscaler_decisions(workers, router_port, args.ttft, args.itl))
    # Simulated workers wait their steps rather than compute them: no shared-core slowdown.
    sim = run_simulation(profile, w, Deployment(args.prefill, args.decode, kv_transport="tcp"),
                         SimOptions(seed=0))  # fmt: skip
    # The same counters the workers export, from the simulated workers' KV cache managers.
    sim_hit = sum(x.kv.hit_tokens for x in sim.workers)
    sim_queried = sum(x.kv.queried_tokens for x in sim.workers)
    report = {
        "workers": n, "startup_s": round(startup, 1), "pss_mb_median": round(mem[len(mem) // 2]),
        "pss_mb_total": round(sum(mem)), "requests": len(reqs), "failed": failed,
        "measured_hit_rate": round(hit / queried, 4) if queried else None,
        "simulated_hit_rate": round(sim_hit / sim_queried, 4) if sim_queried else None,
        "measured_ttft_p90_s": Percentiles.of([m.ttft for m in measured if m.ttft]).p90,
        "simulated_ttft_p90_s": sim.result.ttft.p90,
        "measured_itl_p90_s": Percentiles.of([m.itl for m in measured if m.itl]).p90,
        "simulated_itl_p90_s": sim.result.itl.p90,
        "autoscaler": decisions,
    }  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
