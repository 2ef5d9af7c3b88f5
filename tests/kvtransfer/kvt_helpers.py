"""Helpers for the KV connector tests: small layouts, seeded KV caches, condition waiters."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer.connector import ZmqKVConnector

T = TypeVar("T")
SMALL = KVLayout(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32", num_blocks=64
)


def kv_cache(layout: KVLayout, seed: int | None) -> torch.Tensor:
    """Random bit patterns (seeded) or zeros; random bytes catch any mis-addressed copy."""
    from tandem.engine.kv_layout import DTYPES

    if seed is None:
        return torch.zeros(layout.shape, dtype=DTYPES[layout.dtype])
    gen = torch.Generator().manual_seed(seed)
    nbytes = layout.num_blocks * layout.block_bytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(DTYPES[layout.dtype]).view(layout.shape)


def wait_until(fn: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``fn`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Collector:
    """Accumulates a connector's drained outputs so tests can wait on them by id."""

    def __init__(self, conn: ZmqKVConnector) -> None:
        self.conn = conn
        self.released: list[str] = []
        self.loads: dict[str, Any] = {}

    def poll(self) -> None:
        self.released.extend(self.conn.take_released())
        for r in self.conn.take_finished_loads():
            assert r.request_id not in self.loads, f"load {r.request_id} finished twice"
            self.loads[r.request_id] = r

    def load(self, rid: str, timeout: float = 10.0) -> Any:
        def ready() -> Any:
            self.poll()
            return self.loads.get(rid)

        return wait_until(ready, timeout, f"load {rid}")

    def release(self, rid: str, timeout: float = 10.0) -> None:
        def ready() -> bool:
            self.poll()
            return rid in self.released

        wait_until(ready, timeout, f"release of {rid}")
