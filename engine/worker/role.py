"""What a worker role brings to the shell: its hooks, its connector, its request intake.

``tandem.prefill.PrefillRole`` and ``tandem.decode.DecodeRole`` implement ``WorkerRole``; the
colocated role (no hand-off, no connector) is ``ColocatedRole`` below. The shell calls, in order:
``attach`` once at start-up (before the engine exists), ``intake`` for each generate request on
the engine thread, ``info`` at every registration, ``close`` once at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from prometheus_client import CollectorRegistry

from tandem.engine.builder import EngineParts
from tandem.engine.cluster_token import ClusterToken
from tandem.engine.engine import Engine
from tandem.engine.hooks import ColocatedHooks, RoleHooks
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.worker.protocol import BadRequest, GenerateRequest


@dataclass(slots=True, frozen=True)
class RoleContext:
    """What the shell hands a role at start-up."""

    engine_id: str  # the worker's one engine id (registration, KV events, KV connector)
    host: str  # bind address
    advertise_host: str | None  # the address peers dial, when it differs from host
    registry: CollectorRegistry  # the worker's metrics
    model_name: str
    cluster_token: ClusterToken | None = None  # the KV side channel requires it when set
    kv_side_channel_port: int = 0  # 0: any free port
    kv_data_port: int = 0
    fingerprint: str = "unset"  # engine/fingerprint.py digest: the KV handshake compares it
    identity: str = "unset"  # its readable form
    # Wakes the engine thread from another thread (EngineThread.wake): a role's KV connector
    # calls it when a load ends or blocks are released.
    wake_engine: Callable[[], None] | None = None


class WorkerRole(Protocol):
    role: Role

    def attach(self, parts: EngineParts, ctx: RoleContext) -> RoleHooks:
        """Build what the role needs (e.g. a KV connector over ``parts.runner.kv_cache``) and
        return the hooks the engine runs with. The role owns what it builds until ``close``."""
        ...

    def intake(self, engine: Engine, reqs: list[Request], req: GenerateRequest) -> None:
        """Engine thread, before queueing: apply the request's role fields to ``reqs``; raise
        BadRequest (nothing changes) if this role cannot take them."""
        ...

    def grant(self, engine: Engine, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        """Engine thread: a peer's pull of this worker's cached prefix ``token_ids`` (whole
        blocks): pin and publish its cached leading blocks, returning the grant
        (``KVTransferParams`` wire form) or None when none is cached. BadRequest when this role
        serves no prefix pulls (``refuse_grant``)."""
        ...

    def info(self) -> dict[str, Any]:
        """Role-specific registration fields (``kv_side_channel``)."""
        ...

    def close(self) -> None: ...


def refuse_role_fields(req: GenerateRequest, role: Role, peer: bool = False) -> None:
    """BadRequest for the role fields a worker of ``role`` cannot honour (``peer``: it pulls
    prefixes from peers, ``decode/peer.py``)."""
    if req.kv_prefix_params is not None and not peer:
        raise BadRequest("this worker does not pull prefixes from peers", "kv_prefix_params")
    if req.kv_transfer_params is not None and role != Role.DECODE:
        raise BadRequest(f"this worker does not receive KV ({role.label})", "kv_transfer_params")
    if req.remote_decode and role != Role.PREFILL:
        raise BadRequest("this worker is not a prefill worker", "remote_decode")


class ColocatedRole:
    """Prefill and decode on one worker: the no-op hooks, no connector."""

    role = Role.COLOCATED

    def attach(self, parts: EngineParts, ctx: RoleContext) -> RoleHooks:
        return ColocatedHooks()

    def intake(self, engine: Engine, reqs: list[Request], req: GenerateRequest) -> None:
        refuse_role_fields(req, self.role)

    def grant(self, engine: Engine, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        refuse_grant()

    def info(self) -> dict[str, Any]:
        return {"kv_side_channel": None}

    def close(self) -> None:
        return None


def refuse_grant() -> NoReturn:
    """The ``grant`` of a role that serves no prefix pulls."""
    raise BadRequest("this worker serves no prefix pulls (tandem colocated --kv-peer-pull does)")
