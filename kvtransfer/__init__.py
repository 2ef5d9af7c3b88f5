"""Tandem KV connector: moves finished-prefill KV blocks to decode (DESIGN.md sections 5-6)."""

from tandem.kvtransfer.factory import create_connector
from tandem.kvtransfer.metrics import KVTransferMetrics, create_kv_transfer_metrics
from tandem.kvtransfer.types import (
    FailureReason,
    KVConnector,
    KVLayout,
    KVTransferParams,
    LoadResult,
)

__all__ = [
    "FailureReason",
    "KVConnector",
    "KVLayout",
    "KVTransferMetrics",
    "KVTransferParams",
    "LoadResult",
    "create_connector",
    "create_kv_transfer_metrics",
]
