"""Chaos against one real ``tandem up --prefill 1 --decode 2`` (UCX), shared by the scenarios in
order: mixed shapes with random aborts, a disconnect storm, overload at 5x capacity with mixed
priorities, a decode worker stopped past its heartbeat, then kill -9 of a decode and of the
prefill worker mid-stream, each restarted by ``tandem up``. Each scenario ends with the checks of
``chaos_lib.Cluster.assert_clean``; answers are compared with the healthy cluster's."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_lib import (
    Cluster,
    Outcome,
    Progress,
    Spec,
    check_answers,
    mixed_specs,
    reference_answers,
    run_load,
    summary,
    wait_for,
)

from tandem.engine.demo import sample_inputs

INFLIGHT, QUEUED = 12, 12
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path_factory.mktemp("chaos_up"),
        "--prefill", "1", "--decode", "2", "--kv-transport", "ucx",
        "--max-inflight-requests", str(INFLIGHT), "--max-queued-requests", str(QUEUED),
        "--queue-timeout", "30", "--request-timeout", "60",
        "--engine-option", "num_blocks=512",
    )  # fmt: skip
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def refs(up: Cluster) -> dict[str, str]:
    return {}


def test_mixed_shapes_with_random_aborts(up: Cluster, refs: dict[str, str]) -> None:
    rng = random.Random(11)
    specs = mixed_specs(300, rng, abort_fraction=0.1)
    refs.update(reference_answers(up.url, [s.word for s in specs]))
    outcomes = run_load(up.url, specs, concurrency=INFLIGHT)
    kinds = summary(outcomes)
    assert kinds.get("ok", 0) >= 240 and set(kinds) <= {"ok", "dropped"}, kinds
    check_answers(outcomes, refs)
    up.assert_clean(outcomes)


def test_disconnect_storm_frees_everything(up: Cluster) -> None:
    rng = random.Random(5)
    specs = [
        Spec(w, temperature=1.0, seed=i, max_tokens=64, ignore_eos=True,
             drop_after_chunks=rng.randint(1, 12) if i % 2 else None)
        for i, w in enumerate(sample_inputs(40, seed=5))
    ]  # fmt: skip
    outcomes = run_load(up.url, specs, concurrency=INFLIGHT)
    kinds = summary(outcomes)
    assert kinds == {"ok": 20, "dropped": 20}, kinds
    assert all(o.completion_tokens == 64 for o in outcomes if o.kind == "ok")
    up.assert_clean(outcomes)


def test_overload_sheds_low_priority_and_high_keeps_its_ttft(up: Cluster) -> None:
    words = sample_inputs(5 * INFLIGHT, seed=9)
    specs = [Spec(w, max_tokens=24, priority=(0 if i % 5 == 0 else 10))
             for i, w in enumerate(words)]  # fmt: skip
    before = up.router_metric("tandem_router_rejections_total")
    outcomes = run_load(up.url, specs, concurrency=len(specs))
    high = [o for o in outcomes if o.spec.priority == 0]
    low = [o for o in outcomes if o.spec.priority == 10]
    assert all(o.kind == "ok" for o in high), summary(high)
    refused = [o for o in low if o.kind == "error"]
    assert refused and all(o.status == 429 for o in refused)
    assert {o.error["code"] for o in refused} <= {"queue_full", "shed", "queue_timeout"}
    ttft = sorted(o.ttft_s or 0.0 for o in high)
    assert ttft[-1] < 10.0, ttft  # p99 of 12: the worst
    assert up.router_metric("tandem_router_rejections_total") - before == len(refused)
    up.assert_clean(outcomes)


def long_specs(n: int, seed: int, max_tokens: int = 100) -> list[Spec]:
    return [Spec(w, max_tokens=max_tokens, ignore_eos=True) for w in sample_inputs(n, seed=seed)]


def fault_under_load(up: Cluster, specs: list[Spec], fault) -> list[Outcome]:  # noqa: ANN001
    """Run ``specs`` and call ``fault()`` as soon as the client has output: early in the first
    wave. Timed by the client, not by polling the router (1-2 s a poll on a loaded machine), nor
    by the router's ``generation_tokens_total``, which counts at a request's end."""
    outcomes: list[Outcome] = []
    progress = Progress()
    t = threading.Thread(
        target=lambda: outcomes.extend(run_load(up.url, specs, INFLIGHT, progress=progress))
    )
    t.start()
    wait_for(lambda: progress.chunks > 0, 60, "output", interval=0.01)
    fault()
    t.join(120)
    assert not t.is_alive()
    return outcomes


def test_stopped_decode_past_heartbeat_loses_no_stream(up: Cluster) -> None:
    specs = long_specs(INFLIGHT, seed=21, max_tokens=200)
    reference = run_load(up.url, specs, INFLIGHT)

    def stop_decode() -> None:
        victim = up.freeze_busiest("decode")  # streams are open to it
        url = up.urls[victim]
        try:
            wait_for(lambda: all(w["url"] != url for w in up.workers()), 15,
                     "the stopped worker expired")  # fmt: skip
        finally:
            up.signal(victim, signal.SIGCONT)

    migrations = up.router_metric("tandem_router_migrations_total")
    outcomes = fault_under_load(up, specs, stop_decode)
    assert [o.texts for o in outcomes] == [o.texts for o in reference]
    assert up.router_metric("tandem_router_migrations_total") > migrations  # streams moved
    assert all(o.kind == "ok" and o.completion_tokens == 200 for o in outcomes), summary(outcomes)
    up.wait_registered(3, timeout=30)  # it heartbeats again and re-registers
    up.assert_clean(outcomes)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_killed_worker_loses_no_stream_and_restarts(up: Cluster, role: str) -> None:
    specs = long_specs(2 * INFLIGHT, seed=31 if role == "decode" else 41, max_tokens=200)
    reference = run_load(up.url, specs, INFLIGHT)
    killed: list[str] = []
    migrations = up.router_metric("tandem_router_migrations_total")
    restarts = {name: up.restarts(name) for name in up.pids}

    def kill() -> None:
        # A decode worker dies with streams open to it. A prefill sub-request lasts
        # milliseconds (a poll rarely sees one): the one prefill worker dies at once, mid-load.
        killed.append(up.freeze_busiest(role) if role == "decode" else up.busiest(role))
        up.signal(killed[0], signal.SIGKILL)

    outcomes = fault_under_load(up, specs, kill)
    victim = killed[0]
    before = restarts[victim]
    # Every stream finishes with the full requested length and the uninterrupted greedy text.
    assert all(o.kind == "ok" and o.completion_tokens == 200 for o in outcomes), summary(outcomes)
    assert [o.texts for o in outcomes] == [o.texts for o in reference]
    if role == "decode":
        assert up.router_metric("tandem_router_migrations_total") > migrations
    wait_for(lambda: up.restarts(victim) == before + 1, 30, f"{victim} restarted")
    up.wait_registered(3)
    up.assert_clean(outcomes)
    # The restarted worker serves again, correctly.
    words = sample_inputs(8, seed=51)
    outs = run_load(up.url, [Spec(w, stream=False, max_tokens=24) for w in words], 8)
    assert all(o.kind == "ok" for o in outs)


def test_rss_stays_flat_across_the_run(up: Cluster, tmp_path: Path) -> None:
    """After warm-up, a repeat of the mixed load leaves every worker's RSS within a few
    percent (workers restarted above are warmed up again first)."""
    warm = mixed_specs(120, random.Random(3), abort_fraction=0.0)
    run_load(up.url, warm, INFLIGHT)
    base = up.rss()
    outcomes = run_load(up.url, mixed_specs(240, random.Random(4)), INFLIGHT)
    after = up.rss()
    for name, rss in after.items():
        assert rss <= base[name] * 1.05 + (8 << 20), (name, base[name], rss)
    up.assert_clean(outcomes)
