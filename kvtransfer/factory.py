"""``create_connector``: the one entry point the worker services use."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import torch
import zmq.asyncio

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.kv_layout import KVLayout
from tandem.engine.role import Role
from tandem.engine.sim.cost_model import TransferCost
from tandem.kvtransfer.auth import FrameAuth
from tandem.kvtransfer.connector import ZmqKVConnector
from tandem.kvtransfer.metrics import KVTransferMetrics
from tandem.kvtransfer.tcp_transport import TcpRecvTransport, TcpSendTransport

DEFAULT_LEASE_SECONDS = 10.0
DEFAULT_TRANSFER_TIMEOUT = 30.0
DEFAULT_HANDSHAKE_TIMEOUT = 5.0


def create_connector(
    transport: str,
    layout: KVLayout,
    kv_cache: torch.Tensor,
    role: Role | str,
    host: str = "127.0.0.1",
    side_channel_port: int = 0,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    metrics: KVTransferMetrics | None = None,
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    advertise_host: str | None = None,
    engine_id: str | None = None,
    cluster_token: ClusterToken | None = None,
    data_port: int = 0,
    fingerprint: str = "unset",
    identity: str = "unset",
    simulated: TransferCost | None = None,
    wake: Callable[[], None] | None = None,
) -> ZmqKVConnector:
    """Build a started connector; its side channel listens when ``role`` is prefill or both.

    ``transport`` is ``"ucx"`` (ucxx; TCP/shared-memory/CUDA transports as UCX_TLS allows) or
    ``"tcp"`` (pyzmq). The caller owns the connector and must ``close()`` it; ``kv_cache`` stays
    the caller's and must outlive it.
    ``host`` is where the side channel (and the TCP data socket) listen; ``advertise_host`` is
    the address decode workers dial (the pod IP when ``host`` is ``0.0.0.0``); default ``host``.
    ``transfer_timeout`` bounds each pull phase, ``handshake_timeout`` the first contact.
    ``role`` prefill serves pulls, decode pulls, colocated does both. ``engine_id`` is the
    worker's one engine id (a fresh one when omitted): decode refuses a pull whose params name
    another, so a restarted prefill is never read as its predecessor. ``cluster_token`` seals
    every side-channel frame and proves every data connection (workers always pass theirs;
    None, for in-process tests, seals with an empty key: the same wire, unauthenticated).
    ``side_channel_port`` and ``data_port`` (0: any free port) fix the prefill's listeners so a
    NetworkPolicy can name them. ``fingerprint`` (engine/fingerprint.py; ``identity`` its readable
    form) is compared at every handshake: peers that differ never exchange KV.
    ``simulated`` (simulated workers): the real side channel (sealed as above) over the ``sim``
    data path, each pull waiting the profiled time of ``transport`` for its bytes; ``kv_cache``
    may be a meta tensor. ``wake`` (the engine thread's ``wake``) is called when a load ends or
    published blocks are released, so an engine that only waits on the connector takes them at
    once instead of at its next poll.
    """
    role_enum = Role.parse(role)
    if not 0 < lease_seconds <= 3600:
        raise ValueError("lease_seconds must be in (0, 3600]")
    if transfer_timeout <= 0 or handshake_timeout <= 0:
        raise ValueError("timeouts must be positive")
    zctx = zmq.asyncio.Context.instance()
    auth = FrameAuth(cluster_token)
    wants_send = role_enum in (Role.PREFILL, Role.COLOCATED)
    wants_recv = role_enum in (Role.DECODE, Role.COLOCATED)
    if simulated is not None:
        from tandem.kvtransfer.sim_transport import SimRecvTransport, SimSendTransport

        simulated.seconds(transport, 0)  # ValueError now if the profile lacks this transport
        send = SimSendTransport(lambda n: simulated.seconds(transport, n)) if wants_send else None
        recv = SimRecvTransport() if wants_recv else None
    elif transport == "tcp":
        send = TcpSendTransport(zctx, auth) if wants_send else None
        recv = TcpRecvTransport(zctx, auth) if wants_recv else None
    elif transport == "ucx":
        from tandem.kvtransfer.ucx_transport import (
            UcxRecvTransport,
            UcxRuntime,
            UcxSendTransport,
        )

        runtime = UcxRuntime.get()
        send = UcxSendTransport(runtime, auth) if wants_send else None
        recv = UcxRecvTransport(runtime, auth) if wants_recv else None
    else:
        raise ValueError(f"transport must be ucx or tcp, got {transport!r}")
    return ZmqKVConnector(
        layout=layout,
        kv_cache=kv_cache,
        role=role_enum,
        engine_id=engine_id or uuid.uuid4().hex,
        send=send,
        recv=recv,
        zctx=zctx,
        host=host,
        side_channel_port=side_channel_port,
        lease_seconds=lease_seconds,
        metrics=metrics,
        transfer_timeout=transfer_timeout,
        handshake_timeout=handshake_timeout,
        advertise_host=advertise_host,
        auth=auth,
        data_port=data_port,
        fingerprint=fingerprint,
        identity=identity,
        wake=wake,
    )
