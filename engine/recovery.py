"""Containing a failed engine step, and the engine's accounting (issue: failure containment).

``Engine.step`` calls ``contain`` when a phase of the step raises. The requests the failure can
be attributed to end with an error (an exception while processing one request's output: that
request; in the model run or the scheduler's update: the step's batch); a failure it cannot
attribute (the role hooks, scheduling) fails every request. Then the engine's accounting is
checked (``check_engine_integrity``); if it does not hold, every request is failed, orphaned
block tables are dropped and the check runs again. Only when that fails too does ``contain``
raise ``EngineFailed``: the engine cannot serve, and the worker shell ends every stream, leaves
the router and exits non-zero.

``accounting`` is what the worker's ``/v1/internal/integrity`` reports (the chaos suite's
end-of-run check that an idle worker holds no block and no request).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.request import RequestStatus

if TYPE_CHECKING:
    from tandem.engine.engine import Engine
    from tandem.engine.outputs import EngineOutput
    from tandem.engine.request import Request

log = logging.getLogger(__name__)

_RUNNING = (RequestStatus.RUNNING,)
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class EngineFailed(RuntimeError):
    """The engine's state could not be restored after a failed step; it must not run again."""


@dataclass(slots=True, frozen=True)
class Accounting:
    """Requests and blocks the engine holds right now (taken on the engine thread)."""

    running: int
    waiting: int
    loading: int
    pinned: int
    tracked: int  # requests whose final output is still due
    num_blocks: int
    num_free_blocks: int
    blocks_in_use: int  # blocks some request references (cached free blocks excluded)
    block_tables: int  # requests holding a block table

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self.loading or self.pinned or self.tracked)


def accounting(engine: Engine) -> Accounting:
    s, pool = engine.scheduler, engine.pool
    return Accounting(
        running=len(s.running),
        waiting=len(s.waiting),
        loading=len(s.loading),
        pinned=len(s.pinned),
        tracked=engine.num_tracked,
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        blocks_in_use=sum(1 for b in pool.blocks if b.ref_cnt > 0),
        block_tables=len(engine.kv.held_request_ids()),
    )


def check_engine_integrity(engine: Engine) -> None:
    """Raise AssertionError naming the first inconsistency: the pools and block tables
    (``KVCacheManager.check_integrity``, the host tier's with ``Engine.check_tier_integrity``),
    each queue's statuses, no request in two queues, no reused decode row left by one that
    ended, and every block table owned by a request the scheduler still holds."""
    s = engine.scheduler
    engine.kv.check_integrity()
    engine.check_tier_integrity()
    seen: dict[str, str] = {}
    queues: list[tuple[str, list[Request]]] = [
        ("running", s.running),
        ("waiting", s.waiting),
        ("loading", list(s.loading.values())),
        ("pinned", list(s.pinned.values())),
    ]
    for name, reqs in queues:
        for r in reqs:
            if r.request_id in seen:
                raise AssertionError(f"{r.request_id} is in {seen[r.request_id]} and {name}")
            seen[r.request_id] = name
    stale = (
        s.decode_rows.keys() - {r.request_id for r in [*s.running, *s.waiting]} - s.loading.keys()
    )
    if stale:
        raise AssertionError(f"decode rows of requests no longer queued: {sorted(stale)[:5]}")
    for r in s.running:
        if r.status not in _RUNNING:
            raise AssertionError(f"running request {r.request_id} has status {r.status.name}")
    for r in s.waiting:
        if r.status not in _WAITING:
            raise AssertionError(f"waiting request {r.request_id} has status {r.status.name}")
        if engine.kv.num_blocks_held(r.request_id):
            raise AssertionError(f"waiting request {r.request_id} holds blocks")
    orphans = engine.kv.held_request_ids() - seen.keys()
    if orphans:
        raise AssertionError(f"block tables of unknown requests: {sorted(orphans)[:5]}")


def contain(engine: Engine, exc: Exception, victims: list[Request] | None) -> list[EngineOutput]:
    """Fail ``victims`` (None: every request) after ``exc`` ended a phase of the step, then
    restore the engine's accounting; returns the failed requests' final outputs. Raises
    EngineFailed when the accounting cannot be restored."""
    log.error("engine step failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    message = f"engine step failed: {type(exc).__name__}: {exc}"
    outputs = engine.fail(victims if victims is not None else engine.all_requests(), message)
    try:
        check_engine_integrity(engine)
        return outputs
    except AssertionError as bad:
        log.error("engine accounting broken after a failed step (%s): failing every request", bad)
    outputs += engine.fail(engine.all_requests(), message)
    for rid in engine.kv.held_request_ids() - set(engine.scheduler.loading):
        engine.kv.drop_table(rid)
    try:
        check_engine_integrity(engine)
    except AssertionError as still:
        raise EngineFailed(f"engine state cannot be restored: {still}") from exc
    return outputs
