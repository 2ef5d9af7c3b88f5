"""Decode role intake: a request whose prompt KV lives on a prefill worker (step 1 of the path
in ``decode/hooks.py``)."""

from __future__ import annotations

from typing import Any

from tandem.engine.engine import Engine
from tandem.engine.kv_connector import KVTransferParams
from tandem.engine.request import Request
from tandem.engine.resume import continue_sequence
from tandem.engine.worker.protocol import BadRequest


def attach_remote_kv(engine: Engine, reqs: list[Request], wire: dict[str, Any]) -> None:
    """Validate transfer params against the prompt and this engine; raises BadRequest and leaves
    the request untouched on any mismatch. Called on the engine thread before queueing."""
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
    # Output 0, sampled by the prefill worker: the generator moves past its draw, so seeded
    # sampling goes on as it would have on one worker.
    continue_sequence(req, [params.first_token_id], engine.arch.vocab_size)
    req.kv_transfer_params = params
