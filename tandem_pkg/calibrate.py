"""The serving stage of ``tandem profile``: what the router, the worker shell and the streams add
around the engine's steps, measured through a real `tandem up` of the profiled model.

The step models say what ``Engine.step`` costs alone; serving adds the router's work on each
request, a worker's own loop around each step, and the streaming of every token (worker ->
router -> client), which on a machine where the router and workers share cores takes CPU from
the steps themselves. Measured, with the profile's step model subtracted:

- CPU, from each process's CPU time (``/proc/PID/stat``) over ``CPU_REQUESTS``
  one-at-a-time requests of ``OSL`` tokens and as many of one token: the router's per-request
  and per-token work (``router_request_cpu``, ``router_token_cpu``); the worker's per-token work
  beyond its decode step, streaming the token (``row_seconds``), and its per-request work
  beyond the prefill step (``worker_request_cpu``); over as many 1P1D requests, each side's per
  request beyond its steps (``prefill_request_cpu``, ``decode_request_cpu``: request handling
  and its half of the KV transfer) and the router's beyond its colocated figure
  (``router_handoff_cpu``); and this process's own CPU, the client's, per request and
  per token (``client_request_cpu``, ``client_token_cpu``), for runs whose load generator shares
  the machine; and the same colocated requests ``wake_shares.BATCH`` at a time, from which the
  share of each lone token's CPU that is waking the router's, the client's and the worker's
  streaming thread (``*_wake_share``: a token reaching a busy thread does not pay it);
- colocated, one request at a time: the median ITL (per request, the mean gap after the first
  token) minus the lone decode step the grid measured is ``step_seconds`` (a core is free for
  the streaming thread, so its rows are off the step's path); the first token minus the
  predicted prefill step is the router's part (median, and ``request_spread``), split into
  ``request_seconds`` (at least the router's and the worker's CPU for a request) and
  ``token_seconds``; the ITL of each request over the median is ``pace_spread``;
- 1P1D, one request at a time: the gap from prefill's token to decode's first, minus the
  predicted pull and one decode step, is ``handoff_seconds`` (the connector wakes the idle
  decode engine as the pull ends), its lower quartile, and ``handoff_spread``, its quantiles
  (a served pull took 1.5-3x the transfer stage's, with a tail: docs/planning.md, round 39).

The hand-off is a lower quartile over the requests, as the step times are
(``engine/sim/profiler.py``): other work on the machine only ever adds to a latency. The first
token and the ITL are medians with their spreads, since their tails are what the planner
predicts.

``tandem profile`` measures in segments (``measure_serving``, one after each pass over the
step grid, ``CPU_REQUESTS`` requests per phase split between them) and ``serving_cost`` pools
them: CPU as a mean, each latency as the median of the segments' own. A shared machine's pace
moves in steps lasting minutes: one profile's first-token share came out at 2.8 ms where the
profiles before and after it, of the same code, gave 5.4-6.5 ms. With three segments one such
stretch no longer sets the profile.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.child_command import subcommand, tandem_argv
from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV
from tandem.engine.sim.profile import Profile, ServingCost
from tandem.stream_client import send_batches, stream_times
from tandem.up import worker_port
from tandem.up_config import ROUTER
from tandem.wake_shares import BATCH, mean_run_queue_wait, wake_share

ISL, OSL = 32, 32
# Per phase, split between the segments: CPU time to split per request and per token, and the
# lone ITL. A 34-request segment (100 over three) times 0.4 s of a demo worker's streaming,
# while this host's pace moves over seconds: 16 such segments gave medians of 0.17-0.30 ms
# (CV 21 %) and two profiles 30 minutes apart step_seconds of 0.065 and 0.195 ms;
# 150-request segments gave 0.17-0.21 ms (CV 9 %). docs/planning.md, round 20.
CPU_REQUESTS = 300
WARMUP = 6  # requests a fresh deployment serves before it is timed (its first ones are slow)
CLIENT = "client"  # cpu_per_request's key for this process (no `tandem` subcommand has it)


class LocalUp:
    """A `tandem up` for one measurement (``args``: its flags after the ports); ``with`` waits
    until ``workers`` have registered, exit stops the whole process group. Its cluster token is
    made here and passed in the environment; ``workers()`` lists the registry with it.
    Used by the serving stage and the planner's benchmarks."""

    def __init__(self, args: Sequence[str], workers: int, log_dir: Path, name: str = "up") -> None:
        # Below the ephemeral range (``worker_port``), where no socket's own bind takes them
        # between this probe and the router's bind.
        port = worker_port()
        internal = next(p for p in iter(worker_port, None) if p != port)
        self.url = f"http://127.0.0.1:{port}"
        self.internal_url = f"http://127.0.0.1:{internal}"
        self.token = secrets.token_hex(16)
        cmd = [*tandem_argv("up"), "--port", str(port), "--internal-port", str(internal),
               "--log-dir", str(log_dir), *args]  # fmt: skip
        env = {**os.environ, CLUSTER_TOKEN_ENV: self.token}
        with open(log_dir / f"{name}.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=log_dir)  # fmt: skip
        self.want = workers

    def workers(self) -> list[dict]:
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            r = httpx.get(f"{self.internal_url}/internal/workers", headers=headers, timeout=2)
            return r.json()["workers"] if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def __enter__(self) -> LocalUp:
        deadline = time.monotonic() + 900
        while len(self.workers()) < self.want:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError("tandem up did not start in 900 s")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _stat(proc: Path) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (which may hold spaces): [1] is the
    parent's pid, [11] and [12] user and system CPU in clock ticks."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(proc: Path) -> float:
    """CPU seconds (user + system) a process has used, its ended threads included (``stat``;
    clock-tick resolution, 10 ms: the phases are long enough for that)."""
    fields = _stat(proc)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tandem_children(pid: int) -> list[tuple[str, Path]]:
    """Each child of ``pid`` (a `tandem up`) that runs a `tandem` subcommand: (the subcommand,
    ``router``, ``colocated``, ..., and its /proc directory); [] where /proc cannot say."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat(entry)[1]) != pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        name = subcommand([a.decode(errors="replace") for a in argv])
        if name is not None:
            out.append((name, entry))
    return out


def children_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each child of ``pid`` (a `tandem up`), by its `tandem` subcommand
    (``router``, ``colocated``, ...); {} where /proc cannot say."""
    out: dict[str, float] = {}
    for name, entry in tandem_children(pid):
        try:
            cpu = process_cpu(entry)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        out[name] = out.get(name, 0.0) + cpu
    return out


def cpu_per_request(up: LocalUp, run: Callable[[], int]) -> dict[str, float]:
    """Each child's CPU seconds per request over ``run`` (which returns how many it sent), and
    this process's own (the client's) under ``CLIENT``."""
    before = children_cpu(up.proc.pid)
    own = time.process_time()
    n = run()
    own = time.process_time() - own
    after = children_cpu(up.proc.pid)
    if not n:
        return {}
    return {k: (v - before.get(k, 0.0)) / n for k, v in after.items()} | {CLIENT: own / n}


def _up(model: str, prefill: int, transport: str, options: Sequence[str], threads: int,
        log_dir: Path) -> LocalUp:  # fmt: skip
    args = ["--model", model, "--prefill", str(prefill), "--decode", "1",
            "--kv-transport", transport, "--worker-threads", str(threads)]  # fmt: skip
    for opt in options:
        args += ["--engine-option", opt]
    return LocalUp(args, prefill + 1, log_dir, f"up-{prefill}")


def per_token_cpu(long: float, short: float) -> float:
    """CPU per further token: what an OSL-token request costs a process beyond a one-token
    request, over its OSL - 1 further tokens (never negative: noise can put the short one
    above). ``serving_cost`` and ``benchmarks/wake_sweep.py`` split CPU this way."""
    return max(0.0, (long - short) / (OSL - 1))


def lone_decode_seconds(profile: Profile, context: int) -> float:
    """One sequence's decode step at ``context``, as the profile's grid measured it: the
    nearest lone-decode point, moved to ``context`` along the step model (the model alone when
    the grid has none). A lone decode runs under the fit's line (on random-512 by 2-17 %: one
    row to two adds 0.5-0.8 ms, each further row 0.3), so a served ITL less the fit put that
    residual into ``step_seconds``, clamped at zero, and lost part of the worker's overhead on
    every batched step (docs/planning.md, round 46)."""
    step = profile.step
    # A lone decode point is one group of rows: one sequence, one new token.
    lone = {
        p.rows[0][1]: p
        for p in profile.step_points
        if len(p.rows) == 1 and p.rows[0][0] == 1 and p.rows[0][2] == 1
    }
    if not lone:
        return step.step_seconds([(1, context)])
    ctx = min(lone, key=lambda c: abs(c - context))
    # The model's step counts the host part too (the simulator waits both), so the point's does.
    measured = lone[ctx].execute_seconds + lone[ctx].host_seconds
    return max(0.0, measured + step.step_seconds([(1, context)]) - step.step_seconds([(1, ctx)]))


def _low(values: list[float]) -> float:
    v = sorted(values)
    return v[(len(v) - 1) // 4]


def _complete(runs: list[list[float]]) -> list[list[float]]:
    """Answers of all OSL tokens with a first token and a later one to time."""
    return [t for t in runs if len(t) >= 2]


@dataclass(frozen=True, slots=True)
class ServingSample:
    """One segment's raw measurements (``measure_serving``): each answer's chunk times in the
    order sent, colocated (``alone``) and 1P1D (``pd``), and each process's CPU seconds per
    request (by `tandem` subcommand, the client under ``CLIENT``) over OSL-token requests
    (``cpu_long``), one-token ones (``cpu_short``) and 1P1D ones (``cpu_pd``), and over the
    same colocated requests sent ``wake_shares.BATCH`` at a time (``cpu_batch_long``,
    ``cpu_batch_short``; empty: not measured)."""

    alone: tuple[tuple[float, ...], ...]
    pd: tuple[tuple[float, ...], ...]
    cpu_long: dict[str, float]
    cpu_short: dict[str, float]
    cpu_pd: dict[str, float]
    cpu_batch_long: dict[str, float] = field(default_factory=dict)
    cpu_batch_short: dict[str, float] = field(default_factory=dict)


def measure_serving(
    model: str, transport: str, tokens: Sequence[int], options: Sequence[str] = (),
    threads: int = 1, requests: int = CPU_REQUESTS, seed: int = 0,
) -> ServingSample:  # fmt: skip
    """One segment of the serving stage: a colocated `tandem up` of ``model`` (``requests``
    lone requests of OSL tokens, then as many of one token) and a 1P1D one (``requests`` lone
    requests), each worker on ``threads`` engine threads and ``options`` (``key=value``),
    prompts of ``tokens`` drawn with ``seed``. ``tandem profile`` runs several segments
    between its grid passes (``serving_cost`` pools them)."""
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return rng.choices(tokens, k=ISL)

    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-calibrate-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    # One asyncio client for every phase, made once and reused as a load generator's is (a new
    # httpx client builds an SSL context, ~10-20 ms, which is not the router's time).
    client = httpx.AsyncClient(timeout=120)
    with asyncio.Runner() as runner:

        def stream(up: LocalUp, p: list[int], max_tokens: int = OSL) -> list[float]:
            return runner.run(stream_times(client, up.url, model, p, max_tokens))

        def serial(up: LocalUp, into: list[list[float]]) -> Callable[[], int]:
            def run() -> int:
                into.extend(_complete([stream(up, prompt()) for _ in range(requests)]))
                return requests

            return run

        def batches(up: LocalUp, max_tokens: int) -> Callable[[], int]:
            n = max(BATCH, requests - requests % BATCH)
            prompts = [prompt() for _ in range(n)]
            return lambda: runner.run(send_batches(client, up.url, model, prompts, max_tokens))

        alone: list[list[float]] = []
        pd: list[list[float]] = []
        try:
            with _up(model, 0, transport, options, threads, log_dir) as up:
                for _ in range(WARMUP):
                    stream(up, prompt())

                def one_token() -> int:
                    for _ in range(requests):
                        stream(up, prompt(), max_tokens=1)
                    return requests

                cpu_long = cpu_per_request(up, serial(up, alone))
                cpu_short = cpu_per_request(up, one_token)
                cpu_batch_long = cpu_per_request(up, batches(up, OSL))
                cpu_batch_short = cpu_per_request(up, batches(up, 1))
            with _up(model, 1, transport, options, threads, log_dir) as up:
                for _ in range(WARMUP):
                    stream(up, prompt())
                cpu_pd = cpu_per_request(up, serial(up, pd))
        finally:
            runner.run(client.aclose())
    return ServingSample(
        alone=tuple(tuple(t) for t in alone), pd=tuple(tuple(t) for t in pd),
        cpu_long=cpu_long, cpu_short=cpu_short, cpu_pd=cpu_pd,
        cpu_batch_long=cpu_batch_long, cpu_batch_short=cpu_batch_short,
    )  # fmt: skip


def _mean_cpu(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over segments that measured it (equal requests per segment)."""
    keys = {k for d in dicts for k in d}
    return {k: statistics.fmean(d[k] for d in dicts if k in d) for k in keys}


def _median_of(parts: Sequence[Sequence[float]], stat: Callable[[list[float]], float]) -> float:
    """``stat`` of each non-empty part, then their median: a segment measured in another pace
    of the machine (a step, lasting minutes, seen here between profiles of the same code)
    moves the result by at most the gap to its neighbours, not by its weight in the pool."""
    return statistics.median(stat(list(p)) for p in parts if p)


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2]


def serving_cost(
    profile: Profile, segments: Sequence[ServingSample], transport: str
) -> ServingCost:  # fmt: skip
    """The ServingCost of ``segments`` with ``profile``'s step model subtracted; ValueError if
    they hold no complete answers. CPU figures are means over the segments; latencies are
    each segment's, then the median over segments (one segment: its own figures; two: their
    mean); spreads are quantile by quantile the median of the segments' (one segment:
    ``steady_quantiles`` of its parts)."""
    step = profile.step
    alone = [_complete([list(t) for t in s.alone]) for s in segments]
    pd = [_complete([list(t) for t in s.pd]) for s in segments]
    if not any(alone) or not any(pd):
        raise ValueError("the serving calibration got no complete answers")
    threads = profile.threads
    cpu_long = _mean_cpu([s.cpu_long for s in segments])
    cpu_short = _mean_cpu([s.cpu_short for s in segments])
    cpu_pd = _mean_cpu([s.cpu_pd for s in segments])

    # Per request, the mean gap after the first token (guidellm's ITL, the planner's target):
    # streamed tokens arrive in bursts (several in one read, then a longer gap), so a quantile
    # of single gaps says nothing about the pace.
    itls = [[(t[-1] - t[0]) / (OSL - 1) for t in part] for part in alone]
    itl_median = _median_of(itls, _median)
    decode1 = step.step_seconds([(1, ISL + OSL // 2)])
    prefill = step.step_seconds([(ISL, 0)])
    # CPU: a one-token request costs each process its per-request work; the OSL - 1 further
    # tokens of a full one their per-token work (the worker's includes its decode steps, on
    # every engine thread: OpenMP's threads spin while they wait, so CPU ~ threads x wall).
    r_short, r_long = cpu_short.get(ROUTER, 0.0), cpu_long.get(ROUTER, 0.0)
    router_token = per_token_cpu(r_long, r_short)
    router_request = max(0.0, r_short - router_token)
    c_short, c_long = cpu_short.get(CLIENT, 0.0), cpu_long.get(CLIENT, 0.0)
    client_token = per_token_cpu(c_long, c_short)
    client_request = max(0.0, c_short - client_token)
    w_short, w_long = cpu_short.get("colocated", 0.0), cpu_long.get("colocated", 0.0)
    row = max(0.0, per_token_cpu(w_long, w_short) - decode1 * threads) if w_short else 0.0
    worker_request = max(0.0, w_short - prefill * threads) if w_short else 0.0
    # The same tokens BATCH streams at a time: what of each lone token's cost is a wake-up.
    b_short = _mean_cpu([s.cpu_batch_short for s in segments])
    b_long = _mean_cpu([s.cpu_batch_long for s in segments])

    def batched_token(key: str) -> float:
        return (b_long.get(key, 0.0) - b_short.get(key, 0.0)) / (OSL - 1)

    router_wake = wake_share(router_token, batched_token(ROUTER)) if b_long else 0.0
    client_wake = wake_share(client_token, batched_token(CLIENT)) if b_long else 0.0
    decode_batch = step.step_seconds([(1, ISL + OSL // 2)] * BATCH) / BATCH
    row_batch = batched_token("colocated") - decode_batch * threads
    row_wake = wake_share(row, row_batch) if b_long and w_short else 0.0
    # P/D: each side's CPU per request beyond its steps (and the decode side's rows) is its
    # request handling plus its half of the KV transfer.
    p_cpu, d_cpu = cpu_pd.get("prefill", 0.0), cpu_pd.get("decode", 0.0)
    prefill_request = max(0.0, p_cpu - prefill * threads) if p_cpu else 0.0
    # The router's part of the hand-off: the same requests cost it this much more in P/D.
    r_pd = cpu_pd.get(ROUTER, 0.0)
    router_handoff = max(0.0, r_pd - r_long) if r_pd and r_long else 0.0
    decode_request = max(0.0, d_cpu - (OSL - 1) * (decode1 * threads + row)) if d_cpu else 0.0
    # One request at a time leaves a core free for the worker's streaming thread: its ITL is
    # the step, as the grid measured it, and the step's own overhead.
    step_overhead = max(0.0, itl_median - lone_decode_seconds(profile, ISL + OSL // 2))
    # The first token's serving latency per request: its median, and its spread (beyond the
    # step, its overhead and the streaming of its row, which the simulated worker adds).
    served = [[max(0.0, t[0] - prefill - step_overhead - row) for t in part] for part in alone]
    router = _median_of(served, _median)
    # The first token's latency holds both processes' per-request CPU: the rest is the token's.
    request_part = min(router, max(router * 0.75, router_request + worker_request))
    blocks = -(-ISL // profile.engine.block_size)
    pull = profile.transfer.seconds(transport, blocks * profile.engine.block_bytes)
    # The hand-off gap needs the second chunk to be the second token (decode's first).
    gaps = [[t[1] - t[0] for t in part if len(t) == OSL] for part in pd]
    handoff_gap = _median_of(gaps, _low) if any(gaps) else 0.0
    # The pull, then (the connector wakes the idle engine) decode's first step: the model's
    # step, not the grid's, for it is what the simulator waits there.
    predicted = pull + step.step_seconds([(1, ISL)]) + step_overhead
    beyond = [[max(0.0, g - predicted) for g in part] for part in gaps]
    # Each request's ITL over its own segment's median: the pace within a stretch.
    medians = [(part, _median(part)) for part in itls if part]
    paces = [[v / m for v in part] for part, m in medians if m]
    return ServingCost(
        request_seconds=round(request_part, 6),
        token_seconds=round(router - request_part, 6),
        handoff_seconds=round(max(0.0, handoff_gap - predicted), 6),
        step_seconds=round(step_overhead, 6),
        row_seconds=round(row, 7),
        router_request_cpu=round(router_request, 6),
        router_token_cpu=round(router_token, 7),
        worker_request_cpu=round(worker_request, 6),
        prefill_request_cpu=round(prefill_request, 6),
        decode_request_cpu=round(decode_request, 6),
        router_handoff_cpu=round(router_handoff, 6),
        client_request_cpu=round(client_request, 6),
        client_token_cpu=round(client_token, 7),
        router_wake_share=round(router_wake, 3),
        client_wake_share=round(client_wake, 3),
        row_wake_share=round(row_wake, 3),
        run_queue_wait=mean_run_queue_wait(),
        request_spread=segment_quantiles(served),
        pace_spread=segment_quantiles(paces) if paces else (),
        handoff_spread=segment_quantiles(beyond) if any(beyond) else (),
        pace_seconds=round(
            _median_of([[t[-1] - t[0] for t in part] for part in alone], _median), 6
        ),
    )


def quantiles(values: Sequence[float], n: int = 10) -> tuple[float, ...]:
    """``n`` evenly spaced quantiles (the 5th, 15th, ... percentiles for 10) of ``values``."""
    v = sorted(values)
    return tuple(round(v[min(len(v) - 1, int((i + 0.5) / n * len(v)))], 6) for i in range(n))


SEGMENTS = 4  # consecutive parts of a phase whose quantiles steady_quantiles takes the median of


def steady_quantiles(
    in_order: Sequence[float], n: int = 10, segments: int = SEGMENTS
) -> tuple[float, ...]:
    """``quantiles`` of ``in_order`` (values in the order they were measured), robust to one
    noisy stretch of the phase: the median, quantile by quantile, of the quantiles of
    ``segments`` consecutive parts. Another tenant's burst on a shared machine lasts seconds
    and lands in one part; pooled, it alone set the tail (one profile's first-token p95 came
    out 25 ms against 11 ms for the next). Fewer than 2 values per part: plain quantiles."""
    if len(in_order) < 2 * segments:
        return quantiles(in_order, n)
    size = len(in_order) / segments
    parts = [
        quantiles(in_order[round(i * size) : round((i + 1) * size)], n) for i in range(segments)
    ]
    return tuple(round(statistics.median(q[i] for q in parts), 6) for i in range(n))


def segment_quantiles(segments: Sequence[Sequence[float]], n: int = 10) -> tuple[float, ...]:
    """Quantiles over the serving stage's segments (each in measured order): with three or
    more, quantile by quantile the median of each segment's ``quantiles``, so one segment in
    another pace of the machine does not set them; with fewer, ``steady_quantiles`` of all the
    values in order."""
    parts = [list(p) for p in segments if p]
    if len(parts) < 3:
        return steady_quantiles([v for p in parts for v in p], n)
    per = [quantiles(p, n) for p in parts]
    return tuple(round(statistics.median(q[i] for q in per), 6) for i in range(n))
