"""The worker's metrics, exactly: the engine collector's preemptions by mode and host tier, and
the request latency histograms."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tandem.engine.outputs import EngineStats, HostTierStats, RequestTimings
from tandem.engine.worker.metrics import RequestLatency, worker_registry

COUNTERS = {"prompt_tokens": 11, "generation_tokens": 22, "busy_seconds": 1.5}
LABELS = {"model": "demo", "role": "colocated"}


def registry(host_tier: HostTierStats | None) -> CollectorRegistry:
    stats = EngineStats(
        num_running=1, num_waiting=2, kv_usage=0.5, num_free_blocks=3,
        prefix_queried_tokens=40, prefix_hit_tokens=16, num_preemptions=5,
        num_swap_preemptions=3, host_tier=host_tier,
    )  # fmt: skip
    return worker_registry(lambda: stats, lambda: COUNTERS, "demo", "colocated")


def test_preemptions_are_counted_by_mode() -> None:
    reg = registry(None)
    assert reg.get_sample_value("tandem_preemptions_total", {**LABELS, "mode": "swap"}) == 3
    assert reg.get_sample_value("tandem_preemptions_total", {**LABELS, "mode": "recompute"}) == 2
    assert reg.get_sample_value("tandem_kv_host_tier_blocks", LABELS) is None


def test_engine_counters_are_exposed_as_given() -> None:
    reg = registry(None)
    expected = {
        "tandem_prompt_tokens_total": 11,
        "tandem_generation_tokens_total": 22,
        "tandem_worker_busy_seconds_total": 1.5,
    }
    assert {name: reg.get_sample_value(name, LABELS) for name in expected} == expected


def test_host_tier_metrics_appear_with_a_tier() -> None:
    tier = HostTierStats(
        num_blocks=64, usage=0.25, hit_tokens=48, offloaded_blocks=7, loaded_blocks=3,
        integrity_failures=(("hash_mismatch", 1), ("checksum_mismatch", 2)),
    )  # fmt: skip
    reg = registry(tier)
    expected = {
        "tandem_kv_host_tier_blocks": 64,
        "tandem_kv_host_tier_usage_ratio": 0.25,
        "tandem_prefix_cache_host_hit_tokens_total": 48,
        "tandem_kv_host_tier_offloaded_blocks_total": 7,
        "tandem_kv_host_tier_loaded_blocks_total": 3,
    }
    assert {name: reg.get_sample_value(name, LABELS) for name in expected} == expected
    failures = "tandem_kv_host_tier_integrity_failures_total"
    assert reg.get_sample_value(failures, {**LABELS, "reason": "hash_mismatch"}) == 1
    assert reg.get_sample_value(failures, {**LABELS, "reason": "checksum_mismatch"}) == 2


def test_request_latency_observes_each_phase_exactly() -> None:
    reg = registry(None)
    latency = RequestLatency(reg, "demo", "prefill")
    labels = {"model": "demo", "role": "prefill"}
    latency.observe(RequestTimings(10.0, 10.004, 10.01, 10.5))
    latency.observe(RequestTimings(20.0, None, None, 20.002))  # aborted while it waited
    latency.observe(None)  # an output without timings changes nothing

    def value(name: str, suffix: str, le: str | None = None) -> float | None:
        extra = {} if le is None else {"le": le}
        return reg.get_sample_value(f"{name}_{suffix}", {**labels, **extra})

    assert value("tandem_worker_queue_time_seconds", "count") == 1
    assert value("tandem_worker_queue_time_seconds", "sum") == pytest.approx(0.004)
    assert value("tandem_worker_queue_time_seconds", "bucket", "0.003") == 0
    assert value("tandem_worker_queue_time_seconds", "bucket", "0.005") == 1
    assert value("tandem_worker_time_to_first_token_seconds", "count") == 1
    assert value("tandem_worker_time_to_first_token_seconds", "sum") == pytest.approx(0.01)
    assert value("tandem_worker_request_duration_seconds", "count") == 2
    assert value("tandem_worker_request_duration_seconds", "sum") == pytest.approx(0.502)
