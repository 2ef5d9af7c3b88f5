"""Tandem KV connector: moves finished-prefill KV blocks to decode (DESIGN.md sections 5-6).

Implements ``tandem.engine.kv_connector.KVConnector``; the value types it speaks (layout,
transfer params, load results, failure reasons) are the engine's.
"""

from tandem.kvtransfer.factory import create_connector
from tandem.kvtransfer.metrics import KVTransferMetrics, create_kv_transfer_metrics

__all__ = ["KVTransferMetrics", "create_connector", "create_kv_transfer_metrics"]
