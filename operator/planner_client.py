"""The planner's I/O half: the profile from its ConfigMap, `tandem plan` as a subprocess, and the
per-interval floors the autoscaling timer applies (the pure rules are in planning.py).

Why a subprocess: the planner is the simulator over the engine's own scheduler, and the
operator imports no engine code (an import-linter contract). A second, operator-side planner
would disagree with `tandem plan`; a subprocess runs the same code the user runs, keeps the
operator process small, and bounds a slow or failing plan with a timeout instead of stalling
the event loop. Answers are cached by (profile digest, query); one plan runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.child_command import tandem_argv
from tandem.operator.autoscaler import Pool, PoolSignals
from tandem.operator.children import Replicas
from tandem.operator.kube import KubeClient, object_path
from tandem.operator.planning import (
    PlanAnswer,
    PlanError,
    PlanQuery,
    parse_plan,
    rate_bucket,
    update_correction,
)
from tandem.operator.spec import TandemServiceSpec

MAX_PROFILE_BYTES = 16 << 20


class PlannerClient:
    """Owned by the Controller; shared by every TandemService."""

    def __init__(
        self,
        command: Sequence[str] = tandem_argv(),
        timeout_seconds: float = 120.0,
        cache_size: int = 128,
        retry_seconds: float = 60.0,
    ) -> None:
        self.command = tuple(command)
        self.timeout = timeout_seconds
        self.retry_seconds = retry_seconds
        self._cache: OrderedDict[tuple[str, PlanQuery], PlanAnswer] = OrderedDict()
        # A failed query is not rerun on every pass: its error is returned until retry time.
        self._failed: dict[tuple[str, PlanQuery], tuple[float, PlanError]] = {}
        self._cache_size = cache_size
        self._lock = asyncio.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="tandem-planner-"))
        self.runs = 0

    def _profile_file(self, text: str) -> tuple[str, Path]:
        digest = hashlib.sha256(text.encode()).hexdigest()
        path = self._dir / f"{digest[:32]}.json"
        if not path.exists():
            path.write_text(text)
        return digest, path

    async def plan(self, profile_text: str, query: PlanQuery) -> PlanAnswer:
        digest, path = self._profile_file(profile_text)
        key = (digest, query)
        async with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() < failed[0]:
                raise failed[1]
            try:
                answer = await self._run(query.argv(str(path)))
            except PlanError as exc:
                self._failed[key] = (time.monotonic() + self.retry_seconds, exc)
                raise
            self._failed.pop(key, None)
            self._cache[key] = answer
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return answer

    async def _run(self, argv: list[str]) -> PlanAnswer:
        self.runs += 1
        proc = await asyncio.create_subprocess_exec(
            *self.command, *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=self._dir,  # never a directory whose operator/ would shadow the stdlib
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise PlanError(f"tandem plan did not answer within {self.timeout:g} s") from None
        if proc.returncode not in (0, 1):  # 1: infeasible, still an answer
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise PlanError(f"tandem plan failed ({proc.returncode}): {tail[0][:300]}")
        return parse_plan(out.decode(errors="replace"))

    def close(self) -> None:
        for f in self._dir.glob("*.json"):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._dir.rmdir()


async def read_profile(kube: KubeClient, namespace: str, name: str, spec: TandemServiceSpec) -> str:
    """The profile JSON from the workload's ConfigMap; PlanError naming what is missing."""
    assert spec.workload is not None
    ref = spec.workload.profile_ref(name)
    cm = await kube.get(object_path("v1", "ConfigMap", namespace, ref.config_map))
    if cm is None:
        raise PlanError(f"no ConfigMap {ref.config_map!r} with the profile (key {ref.key!r})")
    text = (cm.get("data") or {}).get(ref.key)
    if not isinstance(text, str) or not text:
        raise PlanError(f"ConfigMap {ref.config_map!r} has no key {ref.key!r}")
    if len(text) > MAX_PROFILE_BYTES:
        raise PlanError(f"the profile in ConfigMap {ref.config_map!r} is too large")
    return text


def query_for(spec: TandemServiceSpec, rate: float) -> PlanQuery:
    w, a = spec.workload, spec.autoscaling
    assert w is not None
    return PlanQuery(
        input_tokens=w.input_tokens,
        output_tokens=w.output_tokens,
        rate=rate_bucket(rate),
        ttft_p90=a.ttft_seconds,
        itl_p90=a.itl_seconds,
        prefix_share=w.prefix_share,
        max_workers=a.prefill.max_replicas + a.decode.max_replicas,
        kv_transport=spec.kv_transport,
        local_prefill_threshold=spec.router.local_prefill_threshold,
        policy=spec.router.policy,
        # A prefill pool that must keep workers cannot become colocated.
        min_prefill=min(a.prefill.min_replicas, a.prefill.max_replicas + a.decode.max_replicas - 1),
    )


@dataclass(slots=True)
class Floors:
    """One interval's planner output for the timer."""

    floors: dict[Pool, int] = field(default_factory=dict)
    plans: dict[Pool, PlanAnswer] = field(default_factory=dict)
    rates: dict[Pool, float] = field(default_factory=dict)
    corrections: dict[Pool, float] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)


def _previous(status: Mapping[str, Any]) -> Mapping[str, Any]:
    block = (status.get("autoscaling") or {}).get("planner")
    return block if isinstance(block, Mapping) else {}


def _correction(prev: Mapping[str, Any], key: str) -> float:
    v = (prev.get("correction") or {}).get(key, 1.0)
    return float(v) if type(v) in (int, float) and v > 0 else 1.0


async def interval_floors(
    planner: PlannerClient,
    profile_text: str,
    spec: TandemServiceSpec,
    signals: Mapping[Pool, PoolSignals | None],
    running: Replicas,
    status: Mapping[str, Any],
) -> Floors:
    """Floors for the observed arrival rate; corrections learned while running the plan."""
    prev = _previous(status)
    out = Floors(status={k: prev[k] for k in ("startReplicas",) if k in prev})
    rate = max((s.arrivals for s in signals.values() if s is not None), default=0.0)
    corrections = {Pool.PREFILL: _correction(prev, "ttft"), Pool.DECODE: _correction(prev, "itl")}
    if rate <= 0:
        out.status.update(message="no traffic observed: no floor", observedRate=0.0,
                          correction={"ttft": corrections[Pool.PREFILL],
                                      "itl": corrections[Pool.DECODE]})  # fmt: skip
        return out
    base = await planner.plan(profile_text, query_for(spec, rate))
    if (running.prefill, running.decode) == (base.prefill, base.decode):
        for pool, predicted in ((Pool.PREFILL, base.ttft_p90), (Pool.DECODE, base.itl_p90)):
            sig = signals.get(pool)
            measured = sig.latency_p90 if sig is not None else None
            corrections[pool] = update_correction(corrections[pool], measured, predicted)
    for pool in (Pool.PREFILL, Pool.DECODE):
        corrected = rate * corrections[pool]
        plan = base
        if rate_bucket(corrected) != rate_bucket(rate):
            plan = await planner.plan(profile_text, query_for(spec, corrected))
        out.plans[pool] = plan
        out.rates[pool] = rate_bucket(corrected)
        out.floors[pool] = plan.prefill if pool is Pool.PREFILL else plan.decode
    out.corrections = corrections
    out.status.update(
        message="floors from the plan for the observed rate",
        observedRate=round(rate, 4),
        plan=base.to_status(),
        floor={"prefill": out.floors[Pool.PREFILL], "decode": out.floors[Pool.DECODE]},
        correction={"ttft": corrections[Pool.PREFILL], "itl": corrections[Pool.DECODE]},
    )
    return out
