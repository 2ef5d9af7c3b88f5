"""Gather the autoscaler's per-pool signals from the pods directly or from Prometheus.

The autoscaling timer builds one source per TandemService (kept in the object's memo, so the
direct source keeps its previous scrapes) and calls `collect` once per interval. Sources own
no HTTP session: the caller passes an aiohttp session it owns.

Warm-up: only pods that have been Ready for `warmup_seconds` contribute worker samples (a cold
pod's queue and cache say little about steady state); the rest are counted by the decision as
capacity coming. Latency comes from the router, measured from each request's arrival, so it
includes time spent queued.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from tandem.operator.autoscaler import Pool, PoolSignals
from tandem.operator.promtext import (
    ExpositionError,
    Snapshot,
    bucket_deltas,
    counter_delta,
    histogram_quantile,
    merge_buckets,
)

TTFT = "tandem_time_to_first_token_seconds"
ITL = "tandem_inter_token_latency_seconds"
ROUTER_REQUESTS = "tandem_router_requests_total"
# Requests that generate; /health, /metrics and /v1/models are not load.
GENERATE_ROUTES = re.compile(r"^/v1/(chat/)?completions$")
QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class PodInfo:
    """One pod of a TandemService, as read from the API server."""

    name: str
    pool: str
    ip: str | None
    port: int
    ready: bool
    ready_seconds: float  # how long it has been Ready; 0 when not ready

    def warm(self, warmup_seconds: float) -> bool:
        return self.ready and self.ready_seconds >= warmup_seconds


class SignalSource(Protocol):
    async def collect(
        self, session: aiohttp.ClientSession, pods: Sequence[PodInfo], now: float
    ) -> dict[Pool, PoolSignals | None]:
        """Signals for prefill and decode; None for a pool where nothing can be judged yet."""
        ...


def _is_generate(labels: Mapping[str, str]) -> bool:
    return bool(GENERATE_ROUTES.match(labels.get("route", "")))


@dataclass(frozen=True, slots=True)
class _Scrape:
    at: float
    snapshot: Snapshot


class DirectSource:
    """Scrapes each pod's /metrics and derives rates and quantiles from consecutive scrapes.

    State: the last scrape per pod; pods that disappear are forgotten. The first interval
    after start (or for a new pod) has no previous scrape, so that pod contributes no rates.
    """

    def __init__(self, warmup_seconds: float, timeout_seconds: float = 3.0) -> None:
        self._warmup = warmup_seconds
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._last: dict[str, _Scrape] = {}

    async def _scrape(self, session: aiohttp.ClientSession, pod: PodInfo) -> Snapshot | None:
        url = f"http://{pod.ip}:{pod.port}/metrics"
        try:
            async with session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                return Snapshot.parse(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ExpositionError):
            return None

    async def collect(
        self, session: aiohttp.ClientSession, pods: Sequence[PodInfo], now: float
    ) -> dict[Pool, PoolSignals | None]:
        # The router is never discounted for warm-up: it measures latency, it does not serve.
        targets = [
            p
            for p in pods
            if p.ip is not None and (p.warm(self._warmup) or (p.pool == "router" and p.ready))
        ]
        snaps = await asyncio.gather(*(self._scrape(session, p) for p in targets))
        pairs: dict[str, list[tuple[_Scrape, _Scrape]]] = {
            "router": [],
            "prefill": [],
            "decode": [],
        }
        fresh: dict[str, _Scrape] = {}
        current: dict[str, list[Snapshot]] = {"router": [], "prefill": [], "decode": []}
        for pod, snap in zip(targets, snaps, strict=True):
            if snap is None:
                continue
            scrape = _Scrape(now, snap)
            fresh[pod.name] = scrape
            current.setdefault(pod.pool, []).append(snap)
            prev = self._last.get(pod.name)
            if prev is not None and now > prev.at:
                pairs.setdefault(pod.pool, []).append((prev, scrape))
        self._last = fresh
        if not pairs["router"]:
            return {Pool.PREFILL: None, Pool.DECODE: None}
        arrivals = sum(
            counter_delta(a.snapshot, b.snapshot, ROUTER_REQUESTS, _is_generate) / (b.at - a.at)
            for a, b in pairs["router"]
        )

        def latency(histogram: str) -> float | None:
            merged = merge_buckets(
                bucket_deltas(a.snapshot, b.snapshot, histogram) for a, b in pairs["router"]
            )
            return histogram_quantile(QUANTILE, merged)

        def rate(pool: str, counter: str) -> float:
            return sum(
                counter_delta(a.snapshot, b.snapshot, counter) / (b.at - a.at)
                for a, b in pairs[pool]
            )

        def pool_signals(pool: str, hist: str, counter: str) -> PoolSignals:
            snaps_now = current[pool]
            usage = [
                v for s in snaps_now if (v := s.mean("tandem_kv_cache_usage_ratio")) is not None
            ]
            return PoolSignals(
                latency_p90=latency(hist),
                waiting=sum(s.total("tandem_requests_waiting") for s in snaps_now),
                running=sum(s.total("tandem_requests_running") for s in snaps_now),
                kv_usage=sum(usage) / len(usage) if usage else None,
                arrivals=arrivals,
                throughput=rate(pool, counter),
                warm_replicas=len(snaps_now),
            )

        return {
            Pool.PREFILL: pool_signals("prefill", TTFT, "tandem_prompt_tokens_total"),
            Pool.DECODE: pool_signals("decode", ITL, "tandem_generation_tokens_total"),
        }


class PromQueryError(RuntimeError):
    """Prometheus answered with an error or something that is not a query result."""


def _selector(base: str, extra: Sequence[str]) -> str:
    return "{" + ",".join(m for m in [base, *extra] if m) + "}"


def promql_queries(selector: str, window_seconds: int, cold_pods: Sequence[str]) -> dict[str, str]:
    """The PromQL the Prometheus source runs; `selector` is label matchers without braces.

    Worker gauges exclude pods still warming up by name (the pod label that PodMonitor adds).
    """
    w = f"{window_seconds}s"
    cold = [f'pod!~"{"|".join(re.escape(p) for p in cold_pods)}"'] if cold_pods else []

    def sel(*extra: str) -> str:
        return _selector(selector, list(extra))

    def worker(role: str) -> str:
        return _selector(selector, [f'role="{role}"', *cold])

    routes = sel('route=~"/v1/(chat/)?completions"')

    def quantile(histogram: str) -> str:
        return f"histogram_quantile({QUANTILE}, sum by (le) (rate({histogram}_bucket{sel()}[{w}])))"

    return {
        "ttft_p90": quantile(TTFT),
        "itl_p90": quantile(ITL),
        "arrivals": f"sum(rate({ROUTER_REQUESTS}{routes}[{w}]))",
        "prefill_waiting": f"sum(tandem_requests_waiting{worker('prefill')})",
        "prefill_running": f"sum(tandem_requests_running{worker('prefill')})",
        "prefill_kv": f"avg(tandem_kv_cache_usage_ratio{worker('prefill')})",
        "prefill_tokens": f"sum(rate(tandem_prompt_tokens_total{worker('prefill')}[{w}]))",
        "decode_waiting": f"sum(tandem_requests_waiting{worker('decode')})",
        "decode_running": f"sum(tandem_requests_running{worker('decode')})",
        "decode_kv": f"avg(tandem_kv_cache_usage_ratio{worker('decode')})",
        "decode_tokens": f"sum(rate(tandem_generation_tokens_total{worker('decode')}[{w}]))",
    }


def parse_scalar_result(body: Any) -> float | None:
    """The single value of an instant-vector query; None for an empty vector or NaN."""
    if not isinstance(body, Mapping) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, Mapping) else None
        raise PromQueryError(f"prometheus query failed: {error or body!r}")
    data = body.get("data")
    if not isinstance(data, Mapping) or data.get("resultType") not in ("vector", "scalar"):
        raise PromQueryError(f"unexpected prometheus result: {data!r}")
    result = data.get("result")
    if data["resultType"] == "scalar":
        value = result[1] if isinstance(result, list) and len(result) == 2 else None
    else:
        if not result:
            return None
        if len(result) != 1:
            raise PromQueryError(f"expected one series, got {len(result)}")
        value = result[0].get("value", [None, None])[1]
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise PromQueryError(f"non-numeric prometheus value {value!r}") from exc
    return None if math.isnan(number) else number


MAX_PROMETHEUS_REPLY_BYTES = 1 << 20  # one instant query's JSON; more is not Prometheus


class PrometheusSource:
    """Reads the same signals from a Prometheus HTTP API (instant queries over `window`).

    The URL is the tenant's (spec.autoscaling.metrics.prometheusUrl), so it is treated as
    hostile: no redirects, each reply read under a size cap, every query and the whole
    collection under a deadline, and any failure, including garbage, only means "no signals"
    for this TandemService (``last_error`` says why; the handler turns it into the
    MetricsAvailable condition and an Event).
    """

    def __init__(
        self,
        base_url: str,
        selector: str,
        window_seconds: int,
        warmup_seconds: float,
        timeout_seconds: float = 5.0,
        max_reply_bytes: int = MAX_PROMETHEUS_REPLY_BYTES,
    ) -> None:
        self._url = base_url.rstrip("/") + "/api/v1/query"
        self._selector = selector
        self._window = window_seconds
        self._warmup = warmup_seconds
        self._deadline = timeout_seconds
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._max_reply = max_reply_bytes
        self.last_error: str | None = None

    async def _query(self, session: aiohttp.ClientSession, promql: str) -> float | None:
        async with session.get(
            self._url, params={"query": promql}, timeout=self._timeout, allow_redirects=False
        ) as r:
            if r.status >= 300:
                raise PromQueryError(f"prometheus answered HTTP {r.status}")
            raw = bytearray()
            while len(raw) <= self._max_reply:
                chunk = await r.content.read(self._max_reply + 1 - len(raw))
                if not chunk:
                    break
                raw += chunk
            if len(raw) > self._max_reply:
                raise PromQueryError(f"prometheus reply exceeds {self._max_reply} bytes")
            try:
                return parse_scalar_result(json.loads(raw))
            except (
                ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError
            ) as exc:  # fmt: skip
                raise PromQueryError(f"unreadable prometheus reply: {type(exc).__name__}") from None

    async def collect(
        self, session: aiohttp.ClientSession, pods: Sequence[PodInfo], now: float
    ) -> dict[Pool, PoolSignals | None]:
        cold = sorted(p.name for p in pods if p.pool != "router" and not p.warm(self._warmup))
        queries = promql_queries(self._selector, self._window, cold)
        try:
            values = await asyncio.wait_for(
                asyncio.gather(*(self._query(session, q) for q in queries.values())),
                self._deadline + 1.0,
            )
        except (aiohttp.ClientError, TimeoutError, PromQueryError, ValueError) as exc:
            self.last_error = _describe(self._url, exc)
            return {Pool.PREFILL: None, Pool.DECODE: None}
        self.last_error = None
        v = dict(zip(queries, values, strict=True))
        if v["arrivals"] is None:
            # No router series at all: the service is not being scraped (yet).
            return {Pool.PREFILL: None, Pool.DECODE: None}

        def count(role: str) -> int:
            return sum(1 for p in pods if p.pool == role and p.warm(self._warmup))

        def pool_signals(role: str, latency: str, tokens: str) -> PoolSignals:
            return PoolSignals(
                latency_p90=v[latency],
                waiting=v[f"{role}_waiting"] or 0.0,
                running=v[f"{role}_running"] or 0.0,
                kv_usage=v[f"{role}_kv"],
                arrivals=v["arrivals"] or 0.0,
                throughput=v[tokens] or 0.0,
                warm_replicas=count(role),
            )

        return {
            Pool.PREFILL: pool_signals("prefill", "ttft_p90", "prefill_tokens"),
            Pool.DECODE: pool_signals("decode", "itl_p90", "decode_tokens"),
        }


def _describe(url: str, exc: BaseException) -> str:
    """A short, bounded reason for the condition and the Event (never the reply itself)."""
    if isinstance(exc, TimeoutError):
        what = "timed out"
    elif isinstance(exc, PromQueryError):
        what = str(exc)
    else:
        what = type(exc).__name__
    return f"{url}: {what}"[:300]
