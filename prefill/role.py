"""PrefillRole: what a prefill worker brings to the worker shell (see engine/worker/role.py)."""

from __future__ import annotations

from typing import Any

from tandem.engine.builder import EngineParts
from tandem.engine.engine import Engine
from tandem.engine.hooks import RoleHooks
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.worker.protocol import GenerateRequest
from tandem.engine.worker.role import RoleContext, refuse_grant, refuse_role_fields
from tandem.kvtransfer import create_connector, create_kv_transfer_metrics
from tandem.kvtransfer.connector import ZmqKVConnector
from tandem.kvtransfer.factory import DEFAULT_TRANSFER_TIMEOUT
from tandem.prefill.hooks import PrefillHooks, mark_remote_decode


class PrefillRole:
    role = Role.PREFILL

    def __init__(
        self,
        kv_transport: str = "ucx",
        kv_lease_seconds: float = 10.0,
        kv_transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
    ) -> None:
        self.kv_transport = kv_transport
        self.kv_lease_seconds = kv_lease_seconds
        self.kv_transfer_timeout = kv_transfer_timeout
        self.connector: ZmqKVConnector | None = None

    def attach(self, parts: EngineParts, ctx: RoleContext) -> RoleHooks:
        metrics = create_kv_transfer_metrics(ctx.registry, ctx.model_name, self.role.label)
        self.connector = create_connector(
            self.kv_transport,
            parts.layout,
            parts.runner.kv_cache,
            self.role,
            host=ctx.host,
            advertise_host=ctx.advertise_host,
            lease_seconds=self.kv_lease_seconds,
            transfer_timeout=self.kv_transfer_timeout,
            metrics=metrics,
            engine_id=ctx.engine_id,
            cluster_token=ctx.cluster_token,
            side_channel_port=ctx.kv_side_channel_port,
            data_port=ctx.kv_data_port,
            fingerprint=ctx.fingerprint,
            identity=ctx.identity,
            simulated=parts.simulated_transfer,
            wake=ctx.wake_engine,
        )
        return PrefillHooks(self.connector)

    def intake(self, engine: Engine, reqs: list[Request], req: GenerateRequest) -> None:
        refuse_role_fields(req, self.role)
        if req.remote_decode:
            mark_remote_decode(reqs)

    def grant(self, engine: Engine, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        refuse_grant()

    def info(self) -> dict[str, Any]:
        side = self.connector.side_channel_address if self.connector is not None else None
        return {"kv_side_channel": side}

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
