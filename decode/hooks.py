"""The decode role's engine hooks: admit a request whose prompt KV is on a prefill worker.

The path of such a request, in order (the scheduler provides the mechanism, this is the policy):

1. ``intake.attach_remote_kv`` validates its ``kv_transfer_params`` against the prompt and puts
   the prefill's first token in as output 0;
2. ``on_admit`` asks the connector to hold the prefill's lease while the request queues here;
3. the scheduler admits it when blocks are free: blocks for the prompt part the local prefix
   cache lacks, status WAITING_FOR_REMOTE_KV, and a ``LoadSpec`` naming exactly those blocks;
4. ``on_scheduled`` starts the pull of each LoadSpec (a pull the connector refuses at once is a
   failed load);
5. ``before_step`` applies finished pulls: whole -> the request runs; failed -> it recomputes
   its prompt locally (``LoadFailurePolicy.RECOMPUTE``, the default) or ends with an error
   (``FAIL``). The blocks stay the scheduler's throughout; nothing frees them while a pull may
   still write them.
"""

from __future__ import annotations

from enum import IntEnum

from tandem.engine.kv_connector import KVConnector
from tandem.engine.outputs import EngineOutput, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler


class LoadFailurePolicy(IntEnum):
    """What a decode worker does when pulling a request's KV fails."""

    RECOMPUTE = 0  # prefill the prompt locally and carry on
    FAIL = 1  # finish the request with an error

    @classmethod
    def parse(cls, value: str | LoadFailurePolicy) -> LoadFailurePolicy:
        if isinstance(value, LoadFailurePolicy):
            return value
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(
                f"kv_load_failure_policy must be recompute or fail; got {value!r}"
            ) from None


class DecodeHooks:
    """Engine-thread hooks over a connector with the decode side (owned by ``DecodeRole``)."""

    def __init__(
        self, connector: KVConnector, policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    ) -> None:
        self.connector = connector
        self.policy = LoadFailurePolicy.parse(policy)

    def on_admit(self, req: Request) -> None:
        if req.remote_decode:
            raise ValueError("a decode worker does not hand requests off")
        if req.kv_transfer_params is not None:
            # Keep the prefill's lease alive while the request queues here for blocks.
            self.connector.hold(req.request_id, req.kv_transfer_params)

    def before_step(self, sched: Scheduler) -> list[Request]:
        ended = []
        for res in self.connector.take_finished_loads():
            reason = res.reason.value if res.reason is not None else None
            detail = f"{reason}: {res.detail}" if res.detail else reason
            req = sched.finish_load(res.request_id, res.ok, detail, fail=self._fail)
            if req is not None:
                ended.append(req)
        return ended

    def on_scheduled(self, sched: Scheduler, out: SchedulerOutput) -> list[Request]:
        ended = []
        for load in out.loads:
            req = load.request
            assert req.kv_transfer_params is not None  # the scheduler loads only such requests
            try:
                self.connector.start_load(
                    req.request_id, req.kv_transfer_params, load.remote_block_ids,
                    load.local_block_ids,
                )  # fmt: skip
            except ValueError as exc:
                # Nothing was started, so nothing writes the blocks: a failed pull, now.
                error = f"invalid transfer: {exc}"
                done = sched.finish_load(req.request_id, False, error, fail=self._fail)
                if done is not None:
                    ended.append(done)
        return ended

    def on_handoff(self, req: Request, out: EngineOutput) -> None:
        raise AssertionError("a decode worker never hands a request off")

    def on_abort(self, req: Request) -> None:
        if req.kv_transfer_params is not None:  # held or loading: the connector tells prefill
            self.connector.abort(req.request_id)

    @property
    def _fail(self) -> bool:
        return self.policy == LoadFailurePolicy.FAIL
