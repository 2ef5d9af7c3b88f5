"""``tandem plan``: the cheapest prefill:decode split for a workload and latency targets.

    tandem plan --profile profile.json --isl 512 --osl 128 --rate 4 --ttft-p90 0.5 \\
        --itl-p90 0.05 [--prefix-share 0.3] [--max-workers 16] [--json]

Prints the plan (fewest workers, then the best margin), the Pareto table of what was
simulated (workers against predicted TTFT and ITL) and the colocated alternative; ``--json``
prints ``{"prefill", "decode", "predicted", "alternatives", ...}`` instead. An SLO no deployment
of at most ``--max-workers`` meets is said plainly, with the closest miss; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.engine.sim.profile import Profile, load_profile
from tandem.planner.search import SLO, Candidate, Planner, PlanResult, predicted
from tandem.planner.simulator import Deployment, SimOptions
from tandem.planner.workload import Arrival, Lengths, Spread, Workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, metavar="PROFILE.json")
    p.add_argument("--isl", type=int, required=True, help="mean input (prompt) tokens")
    p.add_argument("--osl", type=int, required=True, help="mean output tokens")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--ttft-p90", type=float, required=True, metavar="SECONDS")
    p.add_argument("--itl-p90", type=float, required=True, metavar="SECONDS")
    p.add_argument(
        "--prefix-share",
        type=float,
        default=0.0,
        help="fraction of each prompt that is a shared prefix (0..1)",
    )
    p.add_argument("--prefix-groups", type=int, default=1, help="distinct shared prefixes")
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="lengths drawn uniformly within +-this fraction of the mean",
    )
    p.add_argument("--arrival", default="poisson", choices=["poisson", "constant", "gamma"])
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="simulated requests per candidate (default: 60 s of traffic, 200..2000)",
    )
    p.add_argument("--max-workers", type=int, default=16)
    p.add_argument(
        "--min-prefill",
        type=int,
        default=0,
        help="keep at least this many prefill workers (> 0: no colocated plans)",
    )
    p.add_argument(
        "--slo-view",
        default="client",
        choices=["client", "router"],
        help="judge TTFT/ITL as the client sees them (guidellm) or as the router's "
        "histograms record them (the autoscaler's signals)",
    )
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS")
    p.add_argument(
        "--policy", default="prefix-aware", choices=["prefix-aware", "least-load", "round-robin"]
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--shared-cores",
        type=int,
        default=None,
        help="the workers share this many CPU cores (tandem up on one CPU host)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p  # fmt: skip


def workload_from(args: argparse.Namespace) -> Workload:
    spread = Spread.UNIFORM if args.length_spread > 0 else Spread.FIXED
    n = args.requests or max(200, min(2000, round(args.rate * 60)))
    return Workload(
        rate=args.rate,
        isl=Lengths(args.isl, args.length_spread, spread),
        osl=Lengths(args.osl, args.length_spread, spread),
        num_requests=n,
        arrival=Arrival.parse(args.arrival),
        prefix_share=args.prefix_share,
        prefix_groups=args.prefix_groups,
    )


def _line(c: Candidate) -> str:
    r = c.result
    busy = ", ".join(f"{k} busy {p.utilization:.0%}" for k, p in r.pools.items())
    over = " (overloaded: queues grow without bound)" if r.overloaded else ""
    return (
        f"TTFT p90 {c.slo.ttft(r).p90:.3f} s, ITL p90 {c.slo.itl(r).p90:.4f} s, "
        f"e2e p90 {r.e2e.p90:.2f} s; "
        f"{busy}{over}"
    )


def _name(c: Candidate) -> str:
    d = c.deployment
    kind = f"{d.decode} colocated" if d.colocated else f"{d.prefill} prefill + {d.decode} decode"
    return f"{kind} ({d.workers} worker{'s' if d.workers != 1 else ''})"


def render_text(plan: PlanResult, w: Workload, profile: Profile, wall: float) -> str:
    slo = plan.slo
    out = [
        f"tandem plan: {w.isl.mean}-token prompts, {w.osl.mean}-token answers, {w.rate:g} req/s "
        f"({w.arrival.name.lower()}), {w.prefix_share:.0%} shared prefix; "
        f"SLO TTFT p90 <= {slo.ttft_p90:g} s, ITL p90 <= {slo.itl_p90:g} s ({slo.view} view)",
        f"profile: {profile.model.name} on {profile.engine.device} "
        f"({profile.created or 'undated'}); {len(plan.tried)} deployments simulated in "
        f"{wall:.1f} s ({w.num_requests} requests each)",
        "",
    ]
    if plan.best is not None:
        out += [f"plan: {_name(plan.best)}", f"  predicted {_line(plan.best)}"]
    else:
        c = plan.closest
        out += [
            f"infeasible: no deployment of at most {max(x.deployment.workers for x in plan.tried)}"
            " workers meets the SLO.",
            f"closest miss: {_name(c)}: {_line(c)}",
        ]
    alt = plan.best_colocated if plan.best is not plan.best_colocated else plan.best_disaggregated
    if alt is not None:
        label = "colocated" if alt.deployment.colocated else "disaggregated"
        out.append(f"{label} alternative: {_name(alt)}: {_line(alt)}")
    elif plan.best is not None:
        other = "colocated" if not plan.best.deployment.colocated else "disaggregated"
        out.append(f"{other} alternative: none within the worker limit meets the SLO")
    out += ["", f"{'workers':>7}  {'deployment':<14} {'TTFT p90':>9} {'ITL p90':>9}  meets"]
    for c in plan.pareto():
        d = c.deployment
        label = f"{d.decode} colocated" if d.colocated else f"{d.prefill}P{d.decode}D"
        mark = "yes" if c.meets else ("overload" if c.result.overloaded else "no")
        r = c.result
        ttft, itl = c.slo.ttft(r).p90, c.slo.itl(r).p90
        out.append(f"{d.workers:>7}  {label:<14} {ttft:>9.3f} {itl:>9.4f}  {mark}")
    return "\n".join(out)


def render_json(plan: PlanResult, w: Workload) -> dict:
    chosen = plan.best or plan.closest
    d = chosen.deployment
    return {
        "feasible": plan.feasible,
        "prefill": d.prefill,
        "decode": d.decode,
        "colocated": d.colocated,
        "predicted": predicted(chosen.result, plan.slo),
        "margin": chosen.to_dict()["margin"],
        "slo": {"ttft_p90": plan.slo.ttft_p90, "itl_p90": plan.slo.itl_p90, "view": plan.slo.view},
        "workload": {
            "isl": w.isl.mean,
            "osl": w.osl.mean,
            "rate": w.rate,
            "prefix_share": w.prefix_share,
            "arrival": w.arrival.name.lower(),
            "requests": w.num_requests,
        },  # fmt: skip
        "colocated_alternative": plan.best_colocated.to_dict() if plan.best_colocated else None,
        "alternatives": [c.to_dict() for c in plan.pareto()],
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        workload = workload_from(args)
        slo = SLO(args.ttft_p90, args.itl_p90, args.slo_view)
        base = Deployment(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            local_prefill_threshold=args.local_prefill_threshold,
            kv_transport=args.kv_transport,
            policy=args.policy,
        )
        if args.isl + 1 > profile.model.max_model_len:
            raise ValueError(
                f"--isl {args.isl} does not fit max_model_len {profile.model.max_model_len}"
            )
        options = SimOptions(seed=args.seed, shared_cores=args.shared_cores)
        t0 = time.perf_counter()
        plan = Planner(profile, workload, slo, base, options, args.max_workers,
                       min_prefill=args.min_prefill).plan()  # fmt: skip
    except (OSError, ValueError) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps(render_json(plan, workload), indent=1))
    else:
        print(render_text(plan, workload, profile, wall))
    return 0 if plan.feasible else 1
