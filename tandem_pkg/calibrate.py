"""The serving stage of ``tandem profile``: what the router and the worker shell add around the
engine's steps, measured through simulated workers running the profile just made.

Simulated workers (``tandem up --simulate``) run the real router, HTTP streams, worker shell and
connector protocol, and wait the profile's execute time for each step; the scheduler's and
outputs' host time is real too. So whatever a client measures beyond the profile's step model is
the serving overhead the simulator must add (``ServingCost``), and it is measured without the
model's compute:

- colocated, one request at a time: the gaps between tokens minus the predicted decode step are
  ``step_seconds``; the first token minus the predicted prefill step is the router's part,
  split 3:1 into ``request_seconds`` and ``token_seconds`` (a client sees only their sum);
- 1P1D, one request at a time: the gap from prefill's token to decode's first, minus the
  predicted pull, the decode engine's poll and one decode step, is ``handoff_seconds``.

Each is a lower quartile over the requests, as the step times are (``engine/sim/profiler.py``):
other work on the machine only ever adds to a latency.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from tandem.engine.sim.profile import Profile, ServingCost
from tandem.planner.sim_worker import POLL_SECONDS
from tandem.up import free_port

ISL, OSL = 32, 12


def _stream(url: str, model: str, prompt: list[int]) -> list[float]:
    """Seconds from sending to each streamed token."""
    body = {"model": model, "prompt": prompt, "max_tokens": OSL, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if (chunk.get("choices") or [{}])[0].get("text"):
                    times.append(time.perf_counter() - t0)
    return times


def _run(profile_path: Path, model: str, prefill: int, transport: str, requests: int,
         tokens: tuple[int, ...], log_dir: Path) -> list[list[float]]:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "up",
        "--simulate",
        str(profile_path),
        "--model",
        model,
        "--prefill",
        str(prefill),
        "--decode",
        "1",
        "--kv-transport",
        transport,
        "--port",
        str(port),
        "--log-dir",
        str(log_dir),
    ]
    with open(log_dir / f"up-{prefill}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log_dir)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the simulated tandem up exited ({proc.returncode})")
            try:
                workers = httpx.get(f"{url}/internal/workers", timeout=2).json()["workers"]
                if len(workers) == prefill + 1:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated tandem up did not start in 300 s")
            time.sleep(0.3)
        rng = random.Random(prefill)
        out = []
        for i in range(requests + 2):
            times = _stream(url, model, rng.choices(tokens, k=ISL))
            if i >= 2 and len(times) == OSL:  # the first two warm the path up
                out.append(times)
        return out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _low(values: list[float]) -> float:
    v = sorted(values)
    return v[(len(v) - 1) // 4]


def calibrate_serving(
    profile: Profile, model: str, transport: str, requests: int = 12
) -> ServingCost:
    """The profile's ServingCost measured on this machine; ValueError if nothing was measured."""
    step = profile.step
    with tempfile.TemporaryDirectory(prefix="tandem-calibrate-") as tmp:
        path = Path(tmp) / "profile.json"
        replace(profile, serving=ServingCost(0.0, 0.0, 0.0, 0.0)).save(path)
        tokens = profile.model.sim_token_ids
        colocated = _run(path, model, 0, transport, requests, tokens, Path(tmp))
        pd = _run(path, model, 1, transport, requests, tokens, Path(tmp))
    if not colocated or not pd:
        raise ValueError("the serving calibration got no complete answers")
    gaps = [t[i + 1] - t[i] for t in colocated for i in range(len(t) - 1)]
    decode = statistics.median(step.step_seconds([(1, ISL + i)]) for i in range(OSL))
    step_overhead = max(0.0, _low(gaps) - decode)
    first = _low([t[0] for t in colocated])
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
    )
