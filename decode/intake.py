"""Decode role: accepting a request whose prompt KV lives on a prefill worker.

The request enters with the prefill's first token as output 0 and its transfer parameters; the
scheduler allocates blocks only for what the local prefix cache lacks and the engine asks the KV
connector to pull exactly those (``Scheduler._admit_remote``, ``Engine._start_load``).
"""

from __future__ import annotations

from typing import Any

from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.engine.worker_protocol import BadRequest


def attach_remote_kv(engine: Engine, reqs: list[Request], wire: dict[str, Any]) -> None:
    """Validate transfer params against the prompt and this engine; raises BadRequest and leaves
    the request untouched on any mismatch. Called on the engine thread before queueing."""
    from tandem.kvtransfer.types import KVTransferParams

    if engine.connector is None:
        raise BadRequest("this worker does not receive KV (colocated)", "kv_transfer_params")
    try:
        params = KVTransferParams.from_dict(wire)
    except ValueError as exc:
        raise BadRequest(f"kv_transfer_params: {exc}", "kv_transfer_params") from None
    (req,) = reqs  # the protocol allows n = 1 only here
    if params.num_tokens != req.num_prompt_tokens:
        raise BadRequest(
            "kv_transfer_params.num_tokens differs from the prompt length", "kv_transfer_params"
        )
    if len(params.block_ids) != engine.blocks_needed(req.num_prompt_tokens):
        raise BadRequest(
            "kv_transfer_params.block_ids does not cover the prompt", "kv_transfer_params"
        )
    if not 0 <= params.first_token_id < engine.arch.vocab_size:
        raise BadRequest("kv_transfer_params.first_token_id is out of range", "kv_transfer_params")
    if req.max_tokens <= 1:
        raise BadRequest("max_tokens is already reached by the prefill's token", "max_tokens")
    req.append_output_token(params.first_token_id)
    req.kv_transfer_params = params
