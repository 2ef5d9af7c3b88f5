"""Fixtures for the KV connector tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvt_helpers import SMALL, kv_cache

from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import create_connector
from tandem.kvtransfer.connector import ZmqKVConnector


@pytest.fixture
def make() -> Iterator[Callable[..., ZmqKVConnector]]:
    made: list[ZmqKVConnector] = []

    def factory(
        transport: str, role: str, layout: KVLayout = SMALL, seed: int | None = None, **kw: Any
    ) -> ZmqKVConnector:
        kw.setdefault("transfer_timeout", 5.0)
        kw.setdefault("handshake_timeout", 5.0)
        conn = create_connector(transport, layout, kv_cache(layout, seed), role, **kw)
        made.append(conn)
        return conn

    yield factory
    for conn in made:
        conn.close()
