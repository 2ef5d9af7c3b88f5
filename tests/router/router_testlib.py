"""Router test helpers shared by the fixtures and the tests: the served name, the router config
used in tests, a polling wait, and the loopback ``Cluster`` of router + worker doubles."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker_double import TEST_TOKEN, Served, WorkerDouble

from tandem.router.app import RouterConfig
from tandem.router.placement import Policy
from tandem.router.worker_client import Timeouts

MODEL = "test-model"


def router_config(tokenizer_dir: Path, **overrides: Any) -> RouterConfig:
    base = RouterConfig(
        model=MODEL,
        model_path=str(tokenizer_dir),
        policy=Policy.PREFIX_AWARE,
        # Router and doubles share one event loop: on a loaded 2-core CI machine it can stall past
        # a sub-second timeout, expire every worker and cut a stream the test expects whole
        # (CI, stop 24). Tests of expiry itself pass a short timeout.
        heartbeat_timeout_s=3.0,
        expiry_interval_s=0.05,
        events_stale_after_s=5.0,
        timeouts=Timeouts(connect_s=2.0, read_s=10.0, control_s=2.0),
        poll_s=0.05,
        cluster_token=TEST_TOKEN,
    )
    return replace(base, **overrides)


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fails the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Cluster:
    router: Served
    internal: Served  # the router's internal listener: registration, behind the cluster token
    app: Any
    tokenizer: Any
    workers: list[WorkerDouble] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def internal_url(self) -> str:
        return self.internal.url

    @property
    def state(self) -> Any:
        return self.app.state.router

    async def add(self, role: str, **kw: Any) -> WorkerDouble:
        w = WorkerDouble(role=role, tokenizer=self.tokenizer, model=MODEL, **kw)
        await w.start(self.internal_url)
        self.workers.append(w)
        await wait_for(lambda: self.state.registry.is_live(w.engine_id), what="registration")
        await wait_for(lambda: self.state.index.is_synced(w.engine_id), what="kv snapshot")
        return w

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.app.state.metrics.registry.get_sample_value(
            name, {"model": MODEL, **(labels or {})}
        )
        return value or 0.0

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop()
        await self.internal.stop()
        await self.router.stop()
