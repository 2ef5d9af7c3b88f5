"""The prefill role's engine hooks: hand a finished prompt's blocks to a decode worker.

Policy (the mechanism is the scheduler's, see ``Scheduler``): a request marked ``remote_decode``
stops after its first token with its blocks pinned. ``on_handoff`` publishes those blocks through
the KV connector (a lease starts) and puts the ``kv_transfer_params`` on the final output, which
the router hands to a decode worker. Each step, ``before_step`` frees the blocks of every request
the connector released: decode confirmed its copy, failed, aborted, or the lease ran out (a
release that arrives during a transfer waits until the transfer stops reading the blocks).
"""

from __future__ import annotations

from tandem.engine.kv_connector import KVConnector
from tandem.engine.outputs import EngineOutput, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler


class PrefillHooks:
    """Engine-thread hooks over a connector with the prefill side (owned by ``PrefillRole``)."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector

    def on_admit(self, req: Request) -> None:
        if req.kv_transfer_params is not None:
            raise ValueError("a prefill worker does not receive KV")

    def before_step(self, sched: Scheduler) -> list[Request]:
        for rid in self.connector.take_released():
            sched.release_pinned(rid)
        return []  # pinned requests already emitted their final output

    def on_scheduled(self, sched: Scheduler, out: SchedulerOutput) -> list[Request]:
        return []

    def on_handoff(self, req: Request, out: EngineOutput) -> None:
        params = self.connector.publish(
            req.request_id, list(req.block_ids), req.num_prompt_tokens, req.output_token_ids[-1]
        )
        out.kv_transfer_params = params.to_dict()

    def on_abort(self, req: Request) -> None:
        if req.remote_decode:  # published or not: the connector ignores an unknown id
            self.connector.abort(req.request_id)


def mark_remote_decode(reqs: list[Request]) -> None:
    """Intake of a ``remote_decode`` request (engine thread, before queueing)."""
    (req,) = reqs  # the internal protocol allows n = 1 only here
    req.remote_decode = True
