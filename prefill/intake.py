"""Prefill role: accepting a request whose decode happens on another worker.

The scheduler stops such a request after its first sampled token and keeps its blocks pinned
(``Scheduler.pinned``); the engine then publishes them through the KV connector and the final
output carries the ``kv_transfer_params`` the router hands to a decode worker.
"""

from __future__ import annotations

from tandem.engine.config import Role
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.engine.worker_protocol import BadRequest


def mark_remote_decode(engine: Engine, reqs: list[Request]) -> None:
    """Called on the engine thread before the request is queued; raises BadRequest unchanged."""
    if engine.connector is None or engine.scheduler.config.role != Role.PREFILL:
        raise BadRequest("this worker is not a prefill worker", "remote_decode")
    (req,) = reqs  # the protocol allows n = 1 only here
    req.remote_decode = True
