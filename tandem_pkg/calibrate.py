"""The serving stage of ``tandem profile``: what the router, the worker shell and the streams add
around the engine's steps, measured through a real `tandem up` of the profiled model.

The step models say what ``Engine.step`` costs alone; serving adds the router's work on each
request, a worker's own loop around each step, and the streaming of every token (worker ->
router -> client), which on a machine where the router and workers share cores takes CPU from
the steps themselves. Measured, with the profile's step model subtracted:

- colocated, one request at a time: the gap between tokens minus the predicted decode step is
  ``step_seconds``; the first token minus the predicted prefill step is the router's part,
  split 3:1 into ``request_seconds`` and ``token_seconds`` (a client sees only their sum);
- colocated, ``CONCURRENT`` requests at once: the extra gap per additional stream in the batch
  is ``row_seconds``;
- 1P1D, one request at a time: the gap from prefill's token to decode's first, minus the
  predicted pull, the decode engine's poll and one decode step, is ``handoff_seconds``.

Each is a lower quartile over the requests, as the step times are (``engine/sim/profiler.py``):
other work on the machine only ever adds to a latency.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV
from tandem.engine.sim.profile import Profile, ServingCost
from tandem.planner.sim_worker import POLL_SECONDS
from tandem.up import free_port

ISL, OSL, CONCURRENT = 32, 12, 8
WARMUP = 6  # requests a fresh deployment serves before it is timed (its first ones are slow)


def _stream(client: httpx.Client, url: str, model: str, prompt: list[int]) -> list[float]:
    """Seconds from sending to each streamed token. The client is made once and reused, as a
    load generator's is: a new ``httpx`` client builds an SSL context (~10-20 ms), which is not
    the router's time."""
    body = {"model": model, "prompt": prompt, "max_tokens": OSL, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    times = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if (chunk.get("choices") or [{}])[0].get("text"):
                    times.append(time.perf_counter() - t0)
    return times


class LocalUp:
    """A `tandem up` for one measurement (``args``: its flags after the ports); ``with`` waits
    until ``workers`` have registered, exit stops the whole process group. Its cluster token is
    made here and passed in the environment; ``workers()`` lists the registry with it.
    Used by the serving stage and the planner's benchmarks."""

    def __init__(self, args: Sequence[str], workers: int, log_dir: Path, name: str = "up") -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.internal_url = f"http://127.0.0.1:{free_port()}"
        self.token = secrets.token_hex(16)
        cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", self.url.rsplit(":", 1)[1],
               "--internal-port", self.internal_url.rsplit(":", 1)[1], "--log-dir", str(log_dir),
               *args]  # fmt: skip
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


def _up(model: str, prefill: int, transport: str, options: Sequence[str], threads: int,
        log_dir: Path) -> LocalUp:  # fmt: skip
    args = ["--model", model, "--prefill", str(prefill), "--decode", "1",
            "--kv-transport", transport, "--worker-threads", str(threads)]  # fmt: skip
    for opt in options:
        args += ["--engine-option", opt]
    return LocalUp(args, prefill + 1, log_dir, f"up-{prefill}")


def _low(values: list[float]) -> float:
    v = sorted(values)
    return v[(len(v) - 1) // 4]


def _complete(runs: list[list[float]]) -> list[list[float]]:
    return [t for t in runs if len(t) == OSL]


def calibrate_serving(
    profile: Profile, model: str, transport: str, options: Sequence[str] = (),
    requests: int = 12, threads: int | None = None,
) -> ServingCost:  # fmt: skip
    """The profile's ServingCost measured on this machine; ValueError if nothing was measured.
    ``options`` are the engine options (``key=value``) the workers run with, ``threads`` each
    worker's engine threads (default: the profile's, the threads its steps were timed with)."""
    if threads is None:
        recorded = profile.hardware.get("torch_threads", 1)
        threads = recorded if type(recorded) is int and recorded > 0 else 1
    step = profile.step
    rng = random.Random(0)
    tokens = profile.model.sim_token_ids

    def prompt() -> list[int]:
        return rng.choices(tokens, k=ISL)

    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-calibrate-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=120) as client:

        def stream(up: LocalUp, p: list[int]) -> list[float]:
            return _stream(client, up.url, model, p)

        with _up(model, 0, transport, options, threads, log_dir) as up:
            for _ in range(WARMUP):
                stream(up, prompt())
            alone = _complete([stream(up, prompt()) for _ in range(requests)])
            with ThreadPoolExecutor(CONCURRENT) as pool:
                batch = []
                for _ in range(3):
                    prompts = [prompt() for _ in range(CONCURRENT)]
                    batch += _complete(list(pool.map(lambda p: stream(up, p), prompts)))
        with _up(model, 1, transport, options, threads, log_dir) as up:
            for _ in range(WARMUP):
                stream(up, prompt())
            pd = _complete([stream(up, prompt()) for _ in range(requests)])
    if not alone or not batch or not pd:
        raise ValueError("the serving calibration got no complete answers")

    def itl(runs: list[list[float]]) -> list[float]:
        # Per request, the mean gap after the first token (guidellm's ITL, the planner's
        # target): streamed tokens arrive in bursts (several in one read, then a longer gap),
        # so a low quantile of single gaps is ~0 and says nothing about the pace.
        return [(t[-1] - t[1]) / (len(t) - 2) for t in runs]

    decode1 = step.step_seconds([(1, ISL + OSL // 2)])
    step_overhead = max(0.0, _low(itl(alone)) - decode1)
    decode_n = step.step_seconds([(1, ISL + OSL // 2)] * CONCURRENT)
    per_row = (_low(itl(batch)) - decode_n - step_overhead) / (CONCURRENT - 1)
    first = _low([t[0] for t in alone])
    router = max(0.0, first - step.step_seconds([(ISL, 0)]) - step_overhead)
    blocks = -(-ISL // profile.engine.block_size)
    pull = profile.transfer.seconds(transport, blocks * profile.engine.block_bytes)
    handoff_gap = _low([t[1] - t[0] for t in pd])
    predicted = pull + POLL_SECONDS / 2 + step.step_seconds([(1, ISL)]) + step_overhead
    return ServingCost(
        request_seconds=round(router * 0.75, 6),
        token_seconds=round(router * 0.25, 6),
        handoff_seconds=round(max(0.0, handoff_gap - predicted), 6),
        step_seconds=round(step_overhead, 6),
        row_seconds=round(max(0.0, per_row), 7),
    )
