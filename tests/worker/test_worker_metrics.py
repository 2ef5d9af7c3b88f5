"""The worker's engine collector: preemptions by mode and the host tier's metrics, exactly."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.engine.outputs import EngineStats, HostTierStats
from tandem.engine.worker.metrics import worker_registry

COUNTERS = {"prompt_tokens": 11, "generation_tokens": 22}
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
