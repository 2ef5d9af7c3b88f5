"""One repeat of the comparison: every deployment started in turn (same cores), every workload
driven through it by guidellm, worker metrics sampled, and the raw records kept for ``summary``.

Per deployment: warm-up requests (first-forward costs are not measured), the calibration run
(unloaded latencies), each synthetic workload's Poisson rates, then the bursty trace at each load
with the ITL canary running alongside (and once alone: its unloaded ITL). Between runs it waits
until the workers are idle.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from benchlib.client import chat_body, stream_chat
from benchlib.launch import Deployment
from benchlib.metrics import Sampler, histogram, list_workers, scrape, total

from pd_bench import guidellm_driver as gd
from pd_bench.canary import Canary, Stream
from pd_bench.deployments import DeploymentSpec
from pd_bench.latency import bucket_delta
from pd_bench.slo import REQ_FIELDS
from pd_bench.workloads import (
    CALIBRATION,
    Bursty,
    Synthetic,
    bursty_trace,
    poisson_trace,
    write_trace,
)
from tandem.up import UpConfig

SAMPLED = (
    "tandem_requests_running", "tandem_requests_waiting", "tandem_kv_cache_usage_ratio",
    "tandem_kv_transfer_bytes_total", "tandem_kv_transfer_seconds_sum",
    "tandem_kv_transfer_seconds_count", "tandem_prompt_tokens_total",
    "tandem_generation_tokens_total", "tandem_preemptions_total",
)  # fmt: skip
ROUTER_ITL = "tandem_inter_token_latency_seconds"


@dataclass(slots=True, frozen=True)
class Settings:
    model_dir: str
    duration_s: float  # of load per sweep point
    min_requests: int  # per Poisson point
    rate_scale: float
    calibration_requests: int
    canary_alone_s: float
    aux_cpus: str | None
    seed: int
    workloads: tuple[Synthetic | Bursty, ...]
    log: Any = None  # a callable taking one line; None: stderr


def log(settings: Settings, line: str) -> None:
    (settings.log or (lambda s: print(s, file=sys.stderr, flush=True)))(line)


def req_rows(reqs: tuple[Any, ...]) -> list[list[Any]]:
    return [[getattr(r, f) for f in REQ_FIELDS] for r in reqs]


def stream_rows(streams: list[Stream]) -> list[dict[str, Any]]:
    return [{"start": round(s.start, 4), "chunks": [round(w, 4) for w in s.chunks]}
            for s in streams]  # fmt: skip


def warm_up(url: str, model: str) -> None:
    """Two long and two short requests through the router, one at a time."""

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for chars in (1500, 32, 1500, 32):
                await stream_chat(client, url, chat_body(model, (("user", "w" * chars),), 8))

    asyncio.run(go())


def wait_idle(worker_urls: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for u in worker_urls:
            try:
                s = scrape(f"{u}/metrics")
            except httpx.HTTPError:
                busy += 1
                continue
            busy += total(s, "tandem_requests_running") + total(s, "tandem_requests_waiting")
        if busy == 0:
            return
        time.sleep(0.25)


def point_seed(seed: int, workload: str, x: float) -> int:
    """guidellm's seed for one point: the same for every deployment, different for every point
    of one deployment. guidellm's synthetic prompts are a function of the seed, so two runs with
    one seed send the same prompts, and the second would be served from the prefix cache."""
    return seed + zlib.crc32(f"{workload}@{x}".encode()) % 1_000_000


class DeploymentRun:
    """Measures one started deployment; ``record`` is what goes into the report."""

    def __init__(self, spec: DeploymentSpec, dep: Deployment, settings: Settings,
                 workdir: Path) -> None:  # fmt: skip
        self.spec, self.dep, self.s, self.workdir = spec, dep, settings, workdir
        models = httpx.get(f"{dep.url}/v1/models", timeout=10).json()
        self.model = models["data"][0]["id"]
        self.workers = list_workers(dep.internal_url, dep.cluster_headers)
        self.target = gd.Target(dep.url, self.model, settings.model_dir)
        self.record: dict[str, Any] = {"deployment": spec.name, "kind": spec.kind,
                                       "points": [], "errors": []}  # fmt: skip
        self._n = 0

    def _guidellm(self, run: gd.Run, seed: int) -> list[gd.Benchmark]:
        self._n += 1
        wd = self.workdir / f"run{self._n}"
        try:
            return gd.benchmarks(gd.execute(self.target, run, wd, self.s.aux_cpus, seed))
        finally:
            shutil.rmtree(wd, ignore_errors=True)

    def _point(self, workload: str, x: float, run: gd.Run, extra: dict[str, Any],
               canary: Canary | None = None) -> None:  # fmt: skip
        """One guidellm run (with ``canary`` streaming alongside when given), then idle."""
        before = histogram(scrape(f"{self.dep.url}/metrics"), ROUTER_ITL)
        t0 = time.time()
        if canary is not None:
            canary.start()
        try:
            benches = self._guidellm(run, point_seed(self.s.seed, workload, x))
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            self.record["errors"].append(f"{workload} @ {x}: {exc}")
            log(self.s, f"   {workload} @ {x}: FAILED {str(exc)[:300]}")
            return
        finally:
            streams = canary.stop() if canary is not None else []
        after = histogram(scrape(f"{self.dep.url}/metrics"), ROUTER_ITL)
        b = benches[0]
        done = sum(r.completed for r in b.requests)
        point = {
            "workload": workload, "x": x, "start": b.start, "end": b.end,
            "wall_s": round(time.time() - t0, 2), "requests": req_rows(b.requests),
            "router_itl_buckets": bucket_delta(after, before), "request_errors": list(b.errors),
            **extra,
        }  # fmt: skip
        if canary is not None:
            point["canary"] = stream_rows(streams)
        self.record["points"].append(point)
        first_error = f"; errors: {b.errors[0]}" if b.errors else ""
        # guidellm 0.8's replay sometimes leaves out a request of the trace altogether (neither
        # sent nor reported; seen about once per 10 colocated points): say so, and keep the count.
        offered = f" ({extra['offered']} in the trace)" if "offered" in extra else ""
        log(self.s, f"   {workload} @ {x}: {done}/{len(b.requests)} completed{offered}, "
                    f"{time.time() - t0:.0f} s{first_error}")  # fmt: skip
        wait_idle([w["url"] for w in self.workers])

    def run(self) -> dict[str, Any]:
        s = self.s
        names = {self.dep.url: "router", **{w["url"]: w["role"] + "-" + w["engine_id"][:6]
                                            for w in self.workers}}  # fmt: skip
        sampler = Sampler({n: f"{u}/metrics" for u, n in names.items()}, SAMPLED, period_s=1.0)
        warm_up(self.dep.url, self.model)
        sampler.start()
        try:
            short, spread = CALIBRATION
            self._point("calibration", 0.0, gd.synchronous(short.data_arg(), 3, 120), {})
            self._point("calibration", 1.0, gd.synchronous(
                spread.data_arg(), s.calibration_requests, 60 + 30 * s.calibration_requests,
            ), {})  # fmt: skip
            for w in s.workloads:
                if isinstance(w, Synthetic):
                    for rate in w.scaled(s.rate_scale):
                        self._poisson(w, rate)
                else:
                    self._bursty(w)
        finally:
            series = sampler.stop()
        self.record["metrics"] = {n: asdict(v) for n, v in series.items()}
        self.record["metric_scrape_failures"] = sampler.failures
        return self.record

    def _poisson(self, w: Synthetic, rate: float) -> None:
        """One sweep point: ``rate x duration`` requests (at least ``min_requests``: attainment
        needs a population) at exactly ``rate``, replayed by guidellm and waited for."""
        n = max(self.s.min_requests, math.ceil(rate * self.s.duration_s))
        rows = poisson_trace(w.lengths, rate, n, point_seed(self.s.seed, w.name, rate))
        trace = write_trace(rows, self.workdir / f"{w.name}-{rate}.jsonl")
        self._point(w.name, rate, gd.replay(trace, 1.0, n / rate), {"offered": n})

    def _canary(self, w: Bursty) -> Canary:
        return Canary(self.dep.url, self.model, w.canary_streams, w.background_prompt,
                      w.background_output, seed=self.s.seed + 7)  # fmt: skip

    def _bursty(self, w: Bursty) -> None:
        alone = self._canary(w)
        alone.start()
        time.sleep(self.s.canary_alone_s)
        self.record["canary_unloaded"] = stream_rows(alone.stop())
        wait_idle([wk["url"] for wk in self.workers])
        trace = write_trace(bursty_trace(w, self.s.duration_s, self.s.seed),
                            self.workdir / "bursty-trace.jsonl")  # fmt: skip
        for load in w.loads:
            run = gd.replay(trace, load * self.s.rate_scale, self.s.duration_s)
            rate = round(w.rate(load) * self.s.rate_scale, 4)
            self._point(w.name, rate, run, {"load": load}, canary=self._canary(w))


def run_repeat(specs: list[DeploymentSpec], settings: Settings, repeat: int) -> list[dict]:
    """Every deployment of ``specs`` once (reversed order on odd repeats: a shared machine
    drifts, and the order should not favour anyone)."""
    out = []
    order = specs if repeat % 2 == 0 else specs[::-1]
    for spec in order:
        log(settings, f"== repeat {repeat + 1}: {spec.name}")
        config = UpConfig(model=settings.model_dir, port=0, prefill=spec.prefill,
                          decode=spec.decode, kv_transport=spec.kv_transport,
                          local_prefill_threshold=spec.local_prefill_threshold,
                          engine_options=spec.engine_options)  # fmt: skip
        t0 = time.time()
        workdir = Path(tempfile.mkdtemp(prefix=f"tandem-bench-pd-{spec.name}-"))
        try:
            with Deployment(config, spec.placement, log_dir=workdir / "logs") as dep:
                startup = time.time() - t0
                rec = DeploymentRun(spec, dep, settings, workdir).run()
                rec["startup_s"] = round(startup, 1)
                died = dep.dead()
                if died:
                    rec["errors"].append(f"a process died during the run: {died}")
        except Exception as exc:  # noqa: BLE001 - one failed deployment must not end the run
            rec = {"deployment": spec.name, "kind": spec.kind, "points": [],
                   "errors": [f"{type(exc).__name__}: {exc}"]}  # fmt: skip
            log(settings, f"   {spec.name} FAILED: {exc}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        rec["repeat"] = repeat
        rec["wall_s"] = round(time.time() - t0, 1)
        out.append(rec)
    return out
