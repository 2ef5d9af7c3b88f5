"""The loops' CPU per streamed token by concurrency: does a wake-up share hold at every width?

``tandem profile``'s serving stage measures each loop's CPU per token with one stream, then
with ``wake_shares.BATCH`` streams sent together, and takes the share of the lone cost that
the batch saves as the wake-up (``wake_shares.wake_share``). Serving traffic runs a few streams
at a time, started apart. This measures, on one colocated `tandem up`, the router's, the
worker's and this process's (the client's) CPU per token for each width ``B``, sent two ways:

- ``lockstep``: ``B`` streams at once, the next ``B`` when all have finished (the profile's way);
- ``staggered``: ``B`` streams kept in flight, each started a step's pace after the last, a new
  one as soon as one finishes;

and the share each width implies (``wake_share(alone, batched, B)``). A share that holds at
every width and both ways says the profile's eight streams are not what sets it.

    python benchmarks/wake_sweep.py --model demo --profile /tmp/pv/profile-demo.json \\
        --widths 1,2,3,4,8 --requests 96 --repeats 2

(the profile gives the prompts' token ids, as the serving stage's).

Round 42 of docs/planning.md used it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
from plan_validation import model_path, up_args

from tandem.calibrate import CLIENT, ISL, OSL, WARMUP, LocalUp, cpu_per_request, per_token_cpu
from tandem.engine.sim.profile import load_profile
from tandem.stream_client import send_batches, stream_times
from tandem.up_config import ROUTER
from tandem.wake_shares import wake_share

LOOPS = (ROUTER, "colocated", CLIENT)  # the keys of cpu_per_request's answer, in print order


@dataclass(frozen=True, slots=True)
class Width:
    """One width's CPU seconds per token, by process, sent one way."""

    mode: str
    width: int
    per_token: Mapping[str, float]


def per_token(long: Mapping[str, float], short: Mapping[str, float]) -> dict[str, float]:
    """CPU per token, process by process, from CPU per request over OSL-token and one-token
    requests (``calibrate.per_token_cpu``)."""
    return {k: per_token_cpu(v, short.get(k, 0.0)) for k, v in long.items()}


def mean_widths(rows: Sequence[Width]) -> list[Width]:
    """Repeats of the same (mode, width) averaged, process by process, in first-seen order."""
    groups: dict[tuple[str, int], list[Width]] = {}
    for r in rows:
        groups.setdefault((r.mode, r.width), []).append(r)
    out = []
    for (mode, width), group in groups.items():
        keys = group[0].per_token
        out.append(Width(mode, width, {k: statistics.fmean(g.per_token.get(k, 0.0) for g in group)
                                       for k in keys}))  # fmt: skip
    return out


def render(rows: Sequence[Width]) -> str:
    """A table: per mode and width, each loop's CPU per token (us) and the share it implies
    against the same mode's width 1 (none without one)."""
    alone = {r.mode: r.per_token for r in rows if r.width == 1}
    head = " | ".join(f"{k} us/token (share)" for k in LOOPS)
    lines = [f"| mode | B | {head} |", "| --- | ---: |" + " ---: |" * len(LOOPS)]
    for r in rows:
        cells = []
        for k in LOOPS:
            v = r.per_token.get(k, 0.0)
            base = alone.get(r.mode, {}).get(k, 0.0)
            share = f" ({wake_share(base, v, r.width):.2f})" if r.width > 1 and base else ""
            cells.append(f"{v * 1e6:.1f}{share}")
        lines.append(f"| {r.mode} | {r.width} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def staggered(client: httpx.AsyncClient, url: str, model: str,
                    prompts: Sequence[list[int]], max_tokens: int, width: int,
                    gap: float) -> int:  # fmt: skip
    """Stream ``prompts`` ``width`` at a time, the ``i``-th lane starting ``i * gap`` seconds
    late and each lane sending its next prompt as its last one finishes."""
    queue = iter(prompts)

    async def lane(i: int) -> None:
        await asyncio.sleep(i * gap)
        for p in queue:
            await stream_times(client, url, model, p, max_tokens)

    await asyncio.gather(*(lane(i) for i in range(width)))
    return len(prompts)


def sweep(runner: asyncio.Runner, client: httpx.AsyncClient, up: LocalUp, model: str,
          prompt: Callable[[], list[int]], widths: Sequence[int], requests: int,
          repeats: int) -> list[Width]:  # fmt: skip
    """Each repeat, width and mode's CPU per token on ``up``, after WARMUP lone streams and one
    timed one (whose pace per token staggers the lanes)."""
    for _ in range(WARMUP):
        runner.run(stream_times(client, up.url, model, prompt(), OSL))
    t0 = time.perf_counter()
    runner.run(stream_times(client, up.url, model, prompt(), OSL))
    step = (time.perf_counter() - t0) / OSL  # a lone stream's pace per token
    rows: list[Width] = []
    for _ in range(repeats):
        for width in widths:
            for mode in ("lockstep", "staggered"):
                cpu = {}
                for n in (OSL, 1):
                    ps = [prompt() for _ in range(requests)]
                    send = (
                        send_batches(client, up.url, model, ps, n, batch=width)
                        if mode == "lockstep"
                        else staggered(client, up.url, model, ps, n, width, step)
                    )
                    cpu[n] = cpu_per_request(up, partial(runner.run, send))
                rows.append(Width(mode, width, per_token(cpu[OSL], cpu[1])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--profile", required=True, help="a profile of the model (its token ids)")
    ap.add_argument("--widths", default="1,2,3,4,8")
    ap.add_argument("--requests", type=int, default=96, help="per width, mode and length")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        ap.error("--widths: comma-separated integers")
    if not widths or min(widths) < 1 or 1 not in widths or args.requests < 1 or args.repeats < 1:
        ap.error("--widths must hold 1 and be positive; --requests and --repeats positive")
    model = model_path(args.model)
    tokens = load_profile(Path(args.profile)).model.sim_token_ids
    rng = random.Random(0)

    def prompt() -> list[int]:
        return rng.choices(tokens, k=ISL)

    client = httpx.AsyncClient(timeout=120)
    with asyncio.Runner() as runner:
        try:
            with LocalUp(up_args(model, 0, 1, args.threads), 1, Path(tempfile.mkdtemp())) as up:
                rows = sweep(runner, client, up, model, prompt, widths, args.requests, args.repeats)
        finally:
            # Closed in the loop that opened it, whether or not the sweep failed.
            runner.run(client.aclose())
    print(render(mean_widths(rows)))


if __name__ == "__main__":
    main()
