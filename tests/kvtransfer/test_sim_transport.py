"""The simulated data path: the real side channel, the profiled time, no bytes and no memory."""

from __future__ import annotations

import time

import torch
from kvt_helpers import SMALL, Collector, kv_cache
from prometheus_client import CollectorRegistry

from tandem.engine.kv_connector import FailureReason
from tandem.engine.sim.cost_model import LinearModel, TransferCost
from tandem.kvtransfer import create_connector, create_kv_transfer_metrics

FIXED, PER_BYTE = 0.15, 1e-7  # 0.15 s + 0.1 s per MB


def sim_cost() -> TransferCost:
    return TransferCost({"tcp": LinearModel(("transfers", "bytes"), (FIXED, PER_BYTE))})


def meta_cache() -> torch.Tensor:
    return torch.empty(SMALL.shape, dtype=SMALL.torch_dtype, device="meta")


def test_a_simulated_pull_takes_the_profiled_time_through_the_real_protocol() -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "decode")
    prefill = create_connector("tcp", SMALL, meta_cache(), "prefill", simulated=sim_cost())
    decode = create_connector(
        "tcp", SMALL, meta_cache(), "decode", simulated=sim_cost(), metrics=metrics
    )
    try:
        p, d = Collector(prefill), Collector(decode)
        params = prefill.publish("req", [3, 4, 5, 9], 64, 7)
        d_start = time.monotonic()
        decode.start_load("local", params, [4, 5, 9], [10, 11, 12])
        result = d.load("local")
        elapsed = time.monotonic() - d_start
        assert result.ok, result
        nbytes = 3 * SMALL.block_bytes
        assert elapsed >= FIXED + nbytes * PER_BYTE
        assert elapsed < FIXED + nbytes * PER_BYTE + 2.0
        p.release("req")
        labels = {"model": "demo", "role": "decode", "direction": "recv", "transport": "sim"}
        assert registry.get_sample_value("tandem_kv_transfer_bytes_total", labels) == nbytes
    finally:
        decode.close()
        prefill.close()


def test_a_real_decode_never_pairs_with_a_simulated_prefill() -> None:
    prefill = create_connector("tcp", SMALL, meta_cache(), "prefill", simulated=sim_cost())
    decode = create_connector("tcp", SMALL, kv_cache(SMALL, None), "decode", handshake_timeout=2)
    try:
        params = prefill.publish("req", [1, 2], 32, 7)
        decode.start_load("local", params, [1, 2], [1, 2])
        result = Collector(decode).load("local")
        assert (result.ok, result.reason) == (False, FailureReason.HANDSHAKE)
        assert result.detail == "prefill uses sim, decode asked for tcp"
    finally:
        decode.close()
        prefill.close()
