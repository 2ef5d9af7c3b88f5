"""Role hooks: the small interface through which a worker role plugs its policy into the engine.

The engine core knows nothing of prefill or decode workers. It calls these hooks at the edges of
a request's life, on the engine thread, and the role (``tandem.prefill`` / ``tandem.decode``)
decides what happens there, typically by driving a ``KVConnector``:

- ``on_admit``: a request is about to be queued (decode: hold the prefill's lease). Raising
  ValueError refuses it; nothing is queued and no block is taken.
- ``before_step``: once per step, before scheduling (prefill: free pinned blocks decode has
  pulled; decode: apply finished KV loads).
- ``on_scheduled``: the step's ``SchedulerOutput`` is made (decode: start the KV loads it admitted).
- ``on_handoff``: a request finished its prompt and ends here with its blocks pinned
  (prefill: publish them and put the ``kv_transfer_params`` on the output).
- ``on_abort``: a request is aborted (both: tell the connector).

``before_step`` and ``on_scheduled`` return the requests that ended inside the hook, so the engine
emits their final outputs. Colocated workers and the offline ``LLM`` run with ``ColocatedHooks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tandem.engine.outputs import EngineOutput, SchedulerOutput
    from tandem.engine.request import Request
    from tandem.engine.scheduler import Scheduler


class RoleHooks(Protocol):
    def on_admit(self, req: Request) -> None: ...

    def before_step(self, sched: Scheduler) -> list[Request]: ...

    def on_scheduled(self, sched: Scheduler, out: SchedulerOutput) -> list[Request]: ...

    def on_handoff(self, req: Request, out: EngineOutput) -> None: ...

    def on_abort(self, req: Request) -> None: ...


class ColocatedHooks:
    """No role edges: every request prefills and decodes here."""

    def on_admit(self, req: Request) -> None:
        if req.kv_transfer_params is not None or req.remote_decode:
            raise ValueError("a colocated engine neither receives nor hands off KV")

    def before_step(self, sched: Scheduler) -> list[Request]:
        return []

    def on_scheduled(self, sched: Scheduler, out: SchedulerOutput) -> list[Request]:
        return []

    def on_handoff(self, req: Request, out: EngineOutput) -> None:
        raise AssertionError("a colocated engine never hands a request off")

    def on_abort(self, req: Request) -> None:
        return None
