"""Time a P/D hand-off from the client's side: a real 1P1D ``tandem up`` under a replayed load.

A 1P1D request's first token comes from the prefill worker; its second is decode's first, after
the router hands the request over and decode pulls the prompt's KV. The gap between those two
chunks (``first_gap``) is the hand-off as a user sees it, and one of the gaps its ITL averages.
Each round starts a fresh ``tandem up`` (TCP KV transport, one engine thread per worker, as
``plan_validation.py`` runs it), replays Poisson arrivals of fixed-length token-id prompts
(seed 0: every round and every checkout sends the same requests) through
``benchmarks/replay_load.py`` and prints the quantiles of TTFT, the first gap, the gaps after it
and ITL. The case is one of ``plan_validation.py``'s for the demo model (its workload shape,
and its rate from a ``tandem profile`` of the demo, as the validation sets it). To compare two
checkouts, run it from each in turn on the same machine.

    python benchmarks/handoff_gap.py --profile profile-demo.json --workload prefill-heavy \
        --load light --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from plan_validation import case_workload, rates, workloads
from replay_load import Measured, replay

from tandem.calibrate import LocalUp
from tandem.engine.sim.profile import load_profile
from tandem.planner.workload import generate

QUANTILES = (0.1, 0.5, 0.9, 0.99)


def quantiles(values: list[float]) -> dict[str, float]:
    """Nearest-rank quantiles and the mean, in ms."""
    v = sorted(values)
    out = {f"p{round(q * 100)}": 1e3 * v[min(len(v) - 1, int(q * len(v)))] for q in QUANTILES}
    out["mean"] = 1e3 * sum(v) / len(v)
    return out


def summarize(got: list[Measured]) -> dict[str, dict[str, float] | int]:
    # A request with a first gap has its first and last chunk times; three tokens give an ITL
    # and at least one gap after the first.
    ok = [m for m in got if m.error is None and m.first_gap is not None and m.tokens > 2]
    if not ok:
        raise SystemExit("no request streamed three tokens: nothing to time")
    ttft = [m.ttft or 0.0 for m in ok]
    first = [m.first_gap or 0.0 for m in ok]
    later = [((m.e2e or 0.0) - t - g) / (m.tokens - 2)
             for m, t, g in zip(ok, ttft, first, strict=True)]  # fmt: skip
    return {
        "requests": len(got),
        "failed": sum(m.error is not None for m in got),
        "ttft": quantiles(ttft),
        "first_gap": quantiles(first),
        "later_gap": quantiles(later),
        "itl": quantiles([m.itl or 0.0 for m in ok]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", type=Path, required=True, help="a tandem profile of the demo")
    ap.add_argument("--workload", choices=("chat", "prefill-heavy", "decode-heavy"),
                    default="prefill-heavy")  # fmt: skip
    ap.add_argument("--load", choices=("light", "moderate"), default="light")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write every round's summary here")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.duration <= 0:
        ap.error("--rounds must be 1 or more and --duration positive")
    profile = load_profile(a.profile)
    if profile.model.name != "demo":
        ap.error(f"--profile is of {profile.model.name!r}, not the demo model")
    isl, osl = workloads(profile.model.max_model_len)[a.workload]
    rate = rates(profile, isl, osl)[a.load]
    w = case_workload(rate, isl, osl, max(20, round(rate * a.duration)))
    reqs = generate(w, profile.model.sim_token_ids, 0, profile.model.max_model_len)
    print(f"{a.workload} at {a.load} load: {rate} req/s, {isl} tokens in, {osl} out")
    args = ["--model", "demo", "--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
            "--worker-threads", "1"]  # fmt: skip
    rounds = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as logs, LocalUp(args, 2, Path(logs)) as up:
            s = summarize(replay(up.url, "demo", reqs))
        rounds.append(s)
        print(f"round {r + 1}: {s['requests']} requests, {s['failed']} failed (ms)")
        for k in ("ttft", "first_gap", "later_gap", "itl"):
            q = s[k]
            assert isinstance(q, dict)
            print(f"  {k:10s}" + "".join(f" {n} {v:7.2f}" for n, v in q.items()))
        sys.stdout.flush()
    if a.json:
        case = {"workload": a.workload, "load": a.load, "rate": rate, "isl": isl, "osl": osl}
        a.json.write_text(json.dumps({**case, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
