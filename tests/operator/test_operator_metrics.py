"""Metric readers: exposition parsing, histogram quantiles from bucket deltas, the direct pod
scraper and the Prometheus HTTP API source (against loopback test doubles, and against a real
Prometheus when the binary is installed)."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web
from metric_texts import ITL_P90, TTFT_P90, router_text, worker_text

from tandem.operator.autoscaler import Pool
from tandem.operator.promtext import (
    ExpositionError,
    Snapshot,
    bucket_deltas,
    counter_delta,
    histogram_quantile,
)
from tandem.operator.signals import (
    DirectSource,
    PodInfo,
    PrometheusSource,
    PromQueryError,
    parse_scalar_result,
    promql_queries,
)


class Exporter:
    """A loopback HTTP server serving `text(tick)` on /metrics; tick is set by the test, or
    advanced on every scrape when `per_scrape`."""

    def __init__(self, text: Callable[[int], str], per_scrape: bool = False) -> None:
        self.text = text
        self.tick = 0
        self.per_scrape = per_scrape
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.per_scrape:
            self.tick += 1
        return web.Response(text=self.text(self.tick), content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def exporters() -> AsyncIterator[dict[str, Exporter]]:
    made = {
        "router": Exporter(router_text),
        "prefill": Exporter(lambda t: worker_text("prefill", t, 3, 1, 0.2)),
        "decode-a": Exporter(lambda t: worker_text("decode", t, 0, 12, 0.5)),
        "decode-b": Exporter(lambda t: worker_text("decode", t, 1, 12, 0.7)),
        # A pod that only just became ready: a cold queue that must not count.
        "decode-cold": Exporter(lambda t: worker_text("decode", t, 100, 0, 0.0)),
    }
    for e in made.values():
        await e.start()
    yield made
    for e in made.values():
        await e.stop()


def test_snapshot_parses_and_selects() -> None:
    snap = Snapshot.parse(router_text(2))
    assert snap.total("tandem_router_requests_total") == 220
    generate = snap.total(
        "tandem_router_requests_total", lambda labels: labels["route"] == "/v1/completions"
    )
    assert generate == 20


def test_snapshot_rejects_garbage() -> None:
    with pytest.raises(ExpositionError):
        Snapshot.parse('tandem_x{model="demo" 1\n')


def test_counter_delta_handles_reset() -> None:
    before = Snapshot.parse(router_text(5))
    after = Snapshot.parse(router_text(7))
    assert counter_delta(before, after, "tandem_router_requests_total") == 220
    restarted = Snapshot.parse(router_text(1))
    assert counter_delta(before, restarted, "tandem_router_requests_total") == 110


def test_histogram_quantile_from_bucket_deltas() -> None:
    before, after = Snapshot.parse(router_text(3)), Snapshot.parse(router_text(5))
    ttft = bucket_deltas(before, after, "tandem_time_to_first_token_seconds")
    assert ttft == {0.1: 0.0, 0.5: 0.0, 1.0: 20.0, math.inf: 20.0}
    assert histogram_quantile(0.9, ttft) == pytest.approx(TTFT_P90)
    itl = bucket_deltas(before, after, "tandem_inter_token_latency_seconds")
    assert histogram_quantile(0.9, itl) == pytest.approx(ITL_P90)
    assert histogram_quantile(0.5, itl) == pytest.approx(0.01 + 0.04 * 50 / 80)


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.9, {}) is None
    assert histogram_quantile(0.9, {1.0: 0.0, math.inf: 0.0}) is None
    # A rank in the +Inf bucket answers the largest finite bound, as Prometheus does.
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0
    with pytest.raises(ValueError):
        histogram_quantile(1.5, {math.inf: 1.0})


def test_bucket_reset_uses_current_counts() -> None:
    before = Snapshot.parse(router_text(9))
    after = Snapshot.parse(router_text(2))
    assert bucket_deltas(before, after, "tandem_time_to_first_token_seconds")[1.0] == 20.0


def pods_for(exporters: dict[str, Exporter]) -> list[PodInfo]:
    def pod(name: str, pool: str, ready_seconds: float) -> PodInfo:
        return PodInfo(name, pool, "127.0.0.1", exporters[name].port, True, ready_seconds)

    return [
        pod("router", "router", 5.0),  # the router is never discounted
        pod("prefill", "prefill", 600.0),
        pod("decode-a", "decode", 600.0),
        pod("decode-b", "decode", 600.0),
        pod("decode-cold", "decode", 5.0),
        PodInfo("decode-pending", "decode", None, 0, False, 0.0),
    ]


async def test_direct_source(exporters: dict[str, Exporter]) -> None:
    source = DirectSource(warmup_seconds=60)
    pods = pods_for(exporters)
    async with aiohttp.ClientSession() as http:
        for e in exporters.values():
            e.tick = 4
        first = await source.collect(http, pods, now=100.0)
        assert first == {Pool.PREFILL: None, Pool.DECODE: None}  # no rates from one scrape
        for e in exporters.values():
            e.tick = 6
        signals = await source.collect(http, pods, now=110.0)
    prefill, decode = signals[Pool.PREFILL], signals[Pool.DECODE]
    assert prefill is not None and decode is not None
    assert prefill.latency_p90 == pytest.approx(TTFT_P90)
    assert decode.latency_p90 == pytest.approx(ITL_P90)
    assert prefill.arrivals == pytest.approx(2.0)  # 20 generate requests in 10 s
    assert (prefill.waiting, prefill.running, prefill.kv_usage) == (3, 1, 0.2)
    assert prefill.throughput == pytest.approx(200.0)
    assert prefill.warm_replicas == 1
    assert (decode.waiting, decode.running) == (1, 24)  # the cold pod's 100 are discounted
    assert decode.kv_usage == pytest.approx(0.6)
    assert decode.throughput == pytest.approx(80.0)
    assert decode.warm_replicas == 2


async def test_direct_source_survives_dead_pod(exporters: dict[str, Exporter]) -> None:
    source = DirectSource(warmup_seconds=60, timeout_seconds=1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    pods = [*pods_for(exporters), PodInfo("gone", "decode", "127.0.0.1", dead_port, True, 900)]
    async with aiohttp.ClientSession() as http:
        await source.collect(http, pods, now=0.0)
        for e in exporters.values():
            e.tick = 1
        signals = await source.collect(http, pods, now=10.0)
    decode = signals[Pool.DECODE]
    assert decode is not None and decode.warm_replicas == 2


class PromAPIDouble:
    """Answers /api/v1/query from a fixed {query: value} table (None: empty vector)."""

    def __init__(self, answers: dict[str, float | str | None], fail: bool = False) -> None:
        self.answers = answers
        self.fail = fail
        self.seen: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _query(self, request: web.Request) -> web.Response:
        query = request.query["query"]
        self.seen.append(query)
        if self.fail:
            return web.json_response(
                {"status": "error", "errorType": "bad_data", "error": "parse error"}, status=400
            )
        value = self.answers[query]
        result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    async def __aenter__(self) -> PromAPIDouble:
        app = web.Application()
        app.router.add_get("/api/v1/query", self._query)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


SELECTOR = 'namespace="ns",tandem_service="demo"'


def test_promql_queries_shape() -> None:
    q = promql_queries(SELECTOR, 60, cold_pods=["demo-decode-x.1"])
    assert q["ttft_p90"] == (
        "histogram_quantile(0.9, sum by (le) (rate(tandem_time_to_first_token_seconds_bucket"
        '{namespace="ns",tandem_service="demo"}[60s])))'
    )
    assert q["decode_running"] == (
        'sum(tandem_requests_running{namespace="ns",tandem_service="demo",role="decode",'
        'pod!~"demo\\-decode\\-x\\.1"})'
    )
    assert "pod!~" not in promql_queries(SELECTOR, 60, [])["decode_kv"]


async def test_prometheus_source_against_double() -> None:
    pods = [
        PodInfo("p1", "prefill", "10.0.0.1", 8100, True, 600),
        PodInfo("d1", "decode", "10.0.0.2", 8200, True, 600),
        PodInfo("d2", "decode", "10.0.0.3", 8200, True, 600),
        PodInfo("d3", "decode", "10.0.0.4", 8200, True, 1),
    ]
    queries = promql_queries(SELECTOR, 60, ["d3"])
    answers: dict[str, float | str | None] = {
        queries["ttft_p90"]: 1.25,
        queries["itl_p90"]: "NaN",  # no tokens in the window
        queries["arrivals"]: 3.5,
        queries["prefill_waiting"]: 7,
        queries["prefill_running"]: 2,
        queries["prefill_kv"]: 0.3,
        queries["prefill_tokens"]: 900,
        queries["decode_waiting"]: None,
        queries["decode_running"]: 40,
        queries["decode_kv"]: 0.65,
        queries["decode_tokens"]: 120,
    }
    async with PromAPIDouble(answers) as prom, aiohttp.ClientSession() as http:
        source = PrometheusSource(f"http://127.0.0.1:{prom.port}/", SELECTOR, 60, 60)
        signals = await source.collect(http, pods, now=0)
    assert sorted(prom.seen) == sorted(queries.values())
    prefill, decode = signals[Pool.PREFILL], signals[Pool.DECODE]
    assert prefill is not None and decode is not None
    assert (prefill.latency_p90, prefill.waiting, prefill.arrivals) == (1.25, 7, 3.5)
    assert (prefill.throughput, prefill.warm_replicas) == (900, 1)
    assert decode.latency_p90 is None
    assert (decode.waiting, decode.running, decode.kv_usage) == (0.0, 40, 0.65)
    assert decode.warm_replicas == 2


async def test_prometheus_source_error_means_no_signals() -> None:
    async with PromAPIDouble({}, fail=True) as prom, aiohttp.ClientSession() as http:
        source = PrometheusSource(f"http://127.0.0.1:{prom.port}", SELECTOR, 60, 60)
        signals = await source.collect(http, [], now=0)
    assert signals == {Pool.PREFILL: None, Pool.DECODE: None}


class HostilePrometheus:
    """A tenant's prometheusUrl that misbehaves one way per path prefix."""

    def __init__(self) -> None:
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _huge(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"[" * (1 << 20)
        for _ in range(64):  # 64 MiB, endless as far as the reader is concerned
            await resp.write(chunk)
        return resp

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")

    async def _garbage(self, request: web.Request) -> web.Response:
        return web.Response(body=b"\xff\xfe not json")

    async def _odd(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "success",
                                  "data": {"resultType": "vector", "result": [7]}})  # fmt: skip

    async def __aenter__(self) -> HostilePrometheus:
        app = web.Application()
        for name in ("huge", "slow", "redirect", "garbage", "odd"):
            app.router.add_get(f"/{name}/api/v1/query", getattr(self, f"_{name}"))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("huge", "exceeds"),
        ("slow", "timed out"),
        ("redirect", "HTTP 302"),
        ("garbage", "unreadable"),
        ("odd", "unreadable"),
    ],
)
async def test_hostile_prometheus_only_means_no_signals(path: str, why: str) -> None:
    async with HostilePrometheus() as prom, aiohttp.ClientSession() as http:
        source = PrometheusSource(f"http://127.0.0.1:{prom.port}/{path}", SELECTOR, 60, 0,
                                  timeout_seconds=1.0, max_reply_bytes=64 * 1024)  # fmt: skip
        before = _rss_bytes()
        started = time.monotonic()
        signals = await source.collect(http, [], now=0)
        elapsed = time.monotonic() - started
        grew = _rss_bytes() - before
    assert signals == {Pool.PREFILL: None, Pool.DECODE: None}
    assert source.last_error is not None and why in source.last_error
    assert elapsed < 3.0  # the deadline holds, whatever the server does
    # Reading the 11 replies whole would take 704 MiB (the server here shares our process).
    assert grew < 128 * 1024 * 1024


def test_parse_scalar_result_rejects_bad_bodies() -> None:
    with pytest.raises(PromQueryError):
        parse_scalar_result({"status": "error", "error": "boom"})
    with pytest.raises(PromQueryError):
        parse_scalar_result({"status": "success", "data": {"resultType": "matrix"}})
    two = {"metric": {}, "value": [0, "1"]}
    with pytest.raises(PromQueryError):
        parse_scalar_result(
            {"status": "success", "data": {"resultType": "vector", "result": [two, two]}}
        )
    assert (
        parse_scalar_result(
            {"status": "success", "data": {"resultType": "scalar", "result": [0, "2.5"]}}
        )
        == 2.5
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus binary is not installed (apt-get install prometheus)",
)
async def test_prometheus_source_against_real_prometheus(tmp_path) -> None:
    router = Exporter(router_text, per_scrape=True)
    prefill = Exporter(lambda t: worker_text("prefill", t, 3, 1, 0.2), per_scrape=True)
    decode = Exporter(lambda t: worker_text("decode", t, 2, 12, 0.5), per_scrape=True)
    for e in (router, prefill, decode):
        await e.start()
    port = _free_port()
    labels = "{namespace: ns, tandem_service: demo}"
    (tmp_path / "prometheus.yml").write_text(
        f"""global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: router
    static_configs: [{{targets: ['127.0.0.1:{router.port}'], labels: {labels}}}]
  - job_name: workers
    static_configs:
      - targets: ['127.0.0.1:{prefill.port}', '127.0.0.1:{decode.port}']
        labels: {labels}
"""
    )
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        source = PrometheusSource(f"http://127.0.0.1:{port}", SELECTOR, 10, 0)
        pods = [
            PodInfo("p", "prefill", None, 0, True, 99),
            PodInfo("d", "decode", None, 0, True, 99),
        ]
        deadline = time.monotonic() + 40
        signals: dict = {Pool.PREFILL: None}
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                try:
                    signals = await source.collect(http, pods, now=0)
                except aiohttp.ClientError:
                    signals = {Pool.PREFILL: None}
                p, d = signals.get(Pool.PREFILL), signals.get(Pool.DECODE)
                if p is not None and d is not None and p.latency_p90 and d.latency_p90:
                    if p.throughput > 0 and d.throughput > 0:
                        break
                await asyncio.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)
        for e in (router, prefill, decode):
            await e.stop()
    p, d = signals[Pool.PREFILL], signals.get(Pool.DECODE)
    assert p is not None and d is not None, "prometheus never returned the service's series"
    assert p.latency_p90 == pytest.approx(TTFT_P90)
    assert d.latency_p90 == pytest.approx(ITL_P90)
    assert p.arrivals > 0 and p.throughput > 0 and d.throughput > 0
    assert (p.waiting, p.running, p.kv_usage) == (3, 1, 0.2)
    assert (d.waiting, d.running, d.kv_usage) == (2, 12, 0.5)
    assert (p.warm_replicas, d.warm_replicas) == (1, 1)
