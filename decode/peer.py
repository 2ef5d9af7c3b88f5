"""Prefix pulls between peers: a colocated worker that pulls a prompt's cached prefix from
another worker holding it, and serves such pulls of its own cache (``tandem colocated
--kv-peer-pull``; the router's ``--peer-pull-min-tokens`` decides when, docs/internal-api.md).

The path of one pull, in order:

1. the router asks the source for a grant (``POST /v1/internal/kv_grant``): ``grant`` pins the
   leading blocks of the prefix cached there (``Engine.pin_prefix``: a pinned request, as a
   prefill worker's hand-off) and publishes them through the connector (a lease and a transfer
   secret of their own), with the checksum of each block's bytes;
2. the router sends the request to the chosen worker with that grant as ``kv_prefix_params``;
   ``attach_prefix_kv`` validates it against the prompt and the request waits for blocks like a
   decode worker's (``Scheduler._admit_remote``), holding the source's lease meanwhile;
3. ``PeerHooks.on_scheduled`` starts the pull; ``before_step`` checks each finished pull's
   blocks against the grant's checksums, then the request computes the rest of its prompt from
   the pulled prefix. A failed, timed-out, refused or corrupt pull is a cache miss: the request
   recomputes its whole prompt here, never decoding from those blocks;
4. on the source, ``before_step`` frees the pinned blocks once the connector releases them (the
   puller confirmed or gave up, or the lease ran out), never while a transfer reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tandem.decode.hooks import DecodeHooks, LoadFailurePolicy
from tandem.decode.role import DecodeRole
from tandem.engine.builder import EngineParts
from tandem.engine.engine import Engine
from tandem.engine.hooks import RoleHooks
from tandem.engine.kv_checksum import cache_checksums
from tandem.engine.kv_connector import KVConnector, KVTransferParams
from tandem.engine.outputs import SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.role import Role
from tandem.engine.scheduler import Scheduler
from tandem.engine.worker.protocol import BadRequest, GenerateRequest
from tandem.engine.worker.role import RoleContext, refuse_role_fields
from tandem.kvtransfer.factory import DEFAULT_TRANSFER_TIMEOUT
from tandem.kvtransfer.metrics import KVTransferMetrics

CHECKSUM_MISMATCH = "checksum_mismatch"  # the failure metric's reason for a corrupt peer block


class PeerHooks(DecodeHooks):
    """A colocated worker's hooks with a two-sided connector: pull prefixes, serve them."""

    def __init__(
        self, connector: KVConnector, kv_cache: torch.Tensor, metrics: KVTransferMetrics | None
    ) -> None:
        super().__init__(connector, LoadFailurePolicy.RECOMPUTE)  # a failed pull is a miss
        self.kv_cache = kv_cache
        self.metrics = metrics
        # request id -> (local block ids, their expected checksums) of each pull in flight
        self._expected: dict[str, tuple[list[int], list[int]]] = {}

    def before_step(self, sched: Scheduler) -> list[Request]:
        for rid in self.connector.take_released():  # the source side: pulls of our blocks
            sched.release_pinned(rid)
        ended = []
        for res in self.connector.take_finished_loads():
            ok, detail = res.ok, res.detail
            expected = self._expected.pop(res.request_id, None)
            if ok and expected is not None and not self._whole(*expected):
                ok, detail = False, "a pulled block's checksum differs from the grant's"
                if self.metrics is not None:
                    self.metrics.add_failure(CHECKSUM_MISMATCH)
            reason = res.reason.value if res.reason is not None else None
            why = f"{reason}: {detail}" if reason else detail
            req = sched.finish_load(res.request_id, ok, why, fail=False)
            if req is not None:
                ended.append(req)
        return ended

    def on_scheduled(self, sched: Scheduler, out: SchedulerOutput) -> list[Request]:
        for load in out.loads:
            params = load.request.kv_transfer_params
            assert params is not None
            index = {b: i for i, b in enumerate(params.block_ids)}
            sums = [params.block_checksums[index[b]] for b in load.remote_block_ids]
            self._expected[load.request.request_id] = (list(load.local_block_ids), sums)
        ended = super().on_scheduled(sched, out)
        for req in ended:
            self._expected.pop(req.request_id, None)
        return ended

    def on_abort(self, req: Request) -> None:
        # A pull in flight or held (the puller), or a grant of our blocks (the source's pinned
        # request, ``remote_decode``): the connector tells the peer and releases what it can.
        if req.kv_transfer_params is not None or req.remote_decode:
            self.connector.abort(req.request_id)

    def _whole(self, local_block_ids: list[int], sums: list[int]) -> bool:
        got = cache_checksums(self.kv_cache, local_block_ids).tolist()
        return got == sums


def attach_prefix_kv(engine: Engine, reqs: list[Request], wire: dict[str, Any]) -> None:
    """Validate a peer's grant against the prompt (engine thread, before queueing); BadRequest
    and nothing changed on any mismatch."""
    param = "kv_prefix_params"
    try:
        params = KVTransferParams.from_dict(wire)
    except ValueError as exc:
        raise BadRequest(f"{param}: {exc}", param) from None
    (req,) = reqs  # the protocol allows n = 1 only here
    bs = engine.layout.block_size
    if params.num_tokens != len(params.block_ids) * bs or not params.block_ids:
        raise BadRequest(f"{param}.num_tokens must be its blocks' tokens", param)
    if params.num_tokens > (req.num_prompt_tokens - 1) // bs * bs:
        raise BadRequest(f"{param} must leave at least one prompt token to compute", param)
    if len(params.block_checksums) != len(params.block_ids):
        raise BadRequest(f"{param}.block_checksums must name every block", param)
    req.kv_transfer_params = params


class PeerColocatedRole(DecodeRole):
    """A colocated worker with a connector of both sides (``Role.COLOCATED``): the decode
    role's connector and pulls, plus serving grants of its own cache."""

    role = Role.COLOCATED

    def __init__(
        self,
        kv_transport: str = "ucx",
        kv_lease_seconds: float = 10.0,
        kv_transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
    ) -> None:
        super().__init__(kv_transport, kv_lease_seconds, LoadFailurePolicy.RECOMPUTE,
                         kv_transfer_timeout)  # fmt: skip
        self.kv_cache: torch.Tensor | None = None

    def attach(self, parts: EngineParts, ctx: RoleContext) -> RoleHooks:
        metrics = self.connect(parts, ctx)
        assert self.connector is not None
        self.kv_cache = parts.runner.kv_cache
        return PeerHooks(self.connector, self.kv_cache, metrics)

    def intake(self, engine: Engine, reqs: list[Request], req: GenerateRequest) -> None:
        refuse_role_fields(req, self.role, peer=True)
        if req.kv_prefix_params is not None:
            attach_prefix_kv(engine, reqs, req.kv_prefix_params)

    def grant(self, engine: Engine, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        """Engine thread: pin and publish the cached blocks of the prefix ``token_ids``; the
        grant's wire form, or None when none is cached here."""
        assert self.connector is not None and self.kv_cache is not None
        try:
            block_ids = engine.pin_prefix(request_id, token_ids)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt_token_ids") from None
        if not block_ids:
            return None
        try:
            sums = cache_checksums(self.kv_cache, block_ids).tolist()
            bs = engine.layout.block_size
            params = self.connector.publish(request_id, block_ids, len(block_ids) * bs, 0)
        except BaseException:
            engine.scheduler.release_pinned(request_id)  # nothing was handed out
            raise
        return dataclasses.replace(params, block_checksums=tuple(sums)).to_dict()

    def info(self) -> dict[str, Any]:
        side = self.connector.side_channel_address if self.connector is not None else None
        return {"kv_side_channel": side}
