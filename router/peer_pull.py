"""Prefix pulls from a peer, the router's half (the workers' half is decode/peer.py).

Called by ``flow.py`` when a choice prefills on a colocated worker that pulls from peers: if
another such worker of the same fingerprint holds a longer prefix on its device, by at least
``FlowConfig.peer_pull_min_tokens`` (``choose_pull_source``), the router asks it for a grant
(``POST /v1/internal/kv_grant``, a short timeout) and sends the request to the chosen worker
with that grant as ``kv_prefix_params``. No grant (nothing cached there any more, a timeout, a
refusal) means the chosen worker simply recomputes. Counted in
``tandem_router_placements_total{pool="peer", reason="pull"|"pull_refused"}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.role import Role
from tandem.router.placement import Choice, PeerSource, choose_pull_source
from tandem.router.registry import WorkerState
from tandem.router.worker_client import WorkerRejected, WorkerUnavailable

if TYPE_CHECKING:
    from tandem.router.flow import ChoiceJob, FlowContext


@dataclass(slots=True, frozen=True)
class Grant:
    params: dict[str, Any]  # the source's KVTransferParams wire form
    source_url: str
    grant_id: str  # the source's pinned request, aborted when the grant goes unused


def pulls_from_peers(w: WorkerState) -> bool:
    """A colocated worker started with ``--kv-peer-pull`` registers a KV side channel."""
    return w.info.role is Role.COLOCATED and w.info.kv_side_channel is not None


async def peer_grant(
    ctx: FlowContext, job: ChoiceJob, d: WorkerState, d_choice: Choice, suffix: str
) -> Grant | None:
    """A grant of a peer's longer prefix for ``d``, or None (pull off, none better, refused)."""
    if ctx.config.peer_pull_min_tokens <= 0 or not pulls_from_peers(d):
        return None
    bs = d.info.block_size
    peers = [
        w for w in ctx.registry.by_role(Role.COLOCATED)
        if w.info.engine_id != d.info.engine_id and pulls_from_peers(w)
        and w.info.fingerprint == d.info.fingerprint and w.info.block_size == bs
    ]  # fmt: skip
    if not peers:
        return None
    hashes = job.block_hashes(bs)
    sources = [
        PeerSource(w.info.engine_id, ctx.index.overlap(w.info.engine_id, hashes)) for w in peers
    ]
    best = choose_pull_source(
        chosen_cached_blocks=d_choice.cached_blocks,
        sources=sources,
        usable_blocks=(len(job.prompt_token_ids) - 1) // bs,
        block_size=bs,
        min_tokens=ctx.config.peer_pull_min_tokens,
    )
    if best is None:
        return None
    source = ctx.registry.get(best.engine_id)
    if source is None:
        return None
    grant_id = f"{job.request_id}-{job.index}-{suffix}"
    body = {"request_id": grant_id, "prompt_token_ids": job.prompt_token_ids[: best.blocks * bs]}
    try:
        params = await ctx.client.grant(source.info.url, body)
    except (WorkerUnavailable, WorkerRejected):
        params = None
    if params is None:
        ctx.record("peer", "pull_refused")
        return None
    ctx.record("peer", "pull")
    return Grant(params, source.info.url, grant_id)
