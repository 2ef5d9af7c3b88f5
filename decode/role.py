"""DecodeRole: what a decode worker brings to the worker shell (see engine/worker/role.py)."""

from __future__ import annotations

from typing import Any

from tandem.decode.hooks import DecodeHooks, LoadFailurePolicy
from tandem.decode.intake import attach_remote_kv
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
from tandem.kvtransfer.metrics import KVTransferMetrics


class DecodeRole:
    role = Role.DECODE

    def __init__(
        self,
        kv_transport: str = "ucx",
        kv_lease_seconds: float = 10.0,
        load_failure_policy: LoadFailurePolicy | str = LoadFailurePolicy.RECOMPUTE,
        kv_transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
    ) -> None:
        self.kv_transport = kv_transport
        self.kv_lease_seconds = kv_lease_seconds
        self.kv_transfer_timeout = kv_transfer_timeout
        self.load_failure_policy = LoadFailurePolicy.parse(load_failure_policy)
        self.connector: ZmqKVConnector | None = None

    def attach(self, parts: EngineParts, ctx: RoleContext) -> RoleHooks:
        self.connect(parts, ctx)
        assert self.connector is not None
        return DecodeHooks(self.connector, self.load_failure_policy)

    def connect(self, parts: EngineParts, ctx: RoleContext) -> KVTransferMetrics:
        """Build ``self.connector`` (its sides follow ``self.role``); returns its metrics."""
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
        return metrics

    def intake(self, engine: Engine, reqs: list[Request], req: GenerateRequest) -> None:
        refuse_role_fields(req, self.role)
        if req.kv_transfer_params is not None:
            attach_remote_kv(engine, reqs, req.kv_transfer_params)

    def grant(self, engine: Engine, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        refuse_grant()

    def info(self) -> dict[str, Any]:
        return {"kv_side_channel": None}

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
