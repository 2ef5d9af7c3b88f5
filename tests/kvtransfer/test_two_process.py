"""Real process boundaries: bit-exact pulls, and each side dying mid-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from queue import Empty, Queue

import pytest
import torch
from kvt_helpers import SMALL, Collector, kv_cache, wait_until
from prometheus_client import CollectorRegistry

from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import create_kv_transfer_metrics

PEER = Path(__file__).with_name("peer_proc.py")
TRANSPORTS = ["tcp", "ucx"]


class Proc:
    """A peer_proc.py child whose JSON lines are read by a thread into a queue."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(PEER.parent)}
        self.p = subprocess.Popen(
            [sys.executable, str(PEER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: Queue[dict] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(json.loads(line))

    def next(self, key: str, timeout: float = 60.0) -> object:
        while True:
            try:
                msg = self.lines.get(timeout=timeout)
            except Empty:
                raise AssertionError(f"child sent no {key!r} line") from None
            if key in msg:
                return msg[key]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_from_prefill_process_then_prefill_dies(make, transport: str) -> None:
    child = Proc("prefill", transport, "21", json.dumps([[5, 6, 7, 30], [8, 9]]))
    try:
        p1, p2 = (KVTransferParams.from_dict(d) for d in child.next("params"))
        dec = make(transport, "decode", transfer_timeout=30.0)
        dc = Collector(dec)
        dec.start_load("d1", p1, [5, 7, 30], [40, 2, 3])
        assert dc.load("d1", timeout=30).ok
        expected = kv_cache(SMALL, 21)
        for r, loc in ((5, 40), (7, 2), (30, 3)):
            assert torch.equal(dec.kv_cache[loc].view(torch.uint8), expected[r].view(torch.uint8))
        assert child.next("released") == ["req0"]
        # freeze the prefill so the next pull is pending, then kill it
        os.kill(child.p.pid, signal.SIGSTOP)
        dec.start_load("d2", p2, [8, 9], [10, 11])
        child.kill()
        result = dc.load("d2", timeout=20)
        assert not result.ok
        assert result.reason in (FailureReason.PEER_DISCONNECTED, FailureReason.TRANSFER_ERROR)
        assert not dec.kv_cache[10:12].view(torch.uint8).any()
    finally:
        child.kill()


BIG = KVLayout(
    num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16", num_blocks=48
)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_process_dies_mid_transfer_prefill_releases(make, transport: str) -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "prefill")
    pre = make(
        transport,
        "prefill",
        layout=BIG,
        seed=5,
        lease_seconds=1.0,
        metrics=metrics,
        transfer_timeout=3.0,
    )
    pc = Collector(pre)
    child = Proc("decode", transport, json.dumps(BIG.to_wire()))
    try:
        child.next("ready")
        params = pre.publish("victim", list(range(BIG.num_blocks)), 16 * BIG.num_blocks, 1)
        assert child.p.stdin is not None
        child.p.stdin.write(json.dumps(params.to_dict()) + "\n")
        child.p.stdin.flush()
        child.next("started")

        wait_until(lambda: pre.in_flight("victim") > 0, timeout=30, what="the transfer to start")
        child.kill()
        pc.release("victim", timeout=15)
        failures = sum(
            registry.get_sample_value(
                "tandem_kv_transfer_failures_total",
                {"model": "demo", "role": "prefill", "reason": reason},
            )
            or 0
            for reason in ("lease_expired", "transfer_error")
        )
        assert failures >= 1  # released because decode vanished, not because it confirmed
    finally:
        child.kill()
