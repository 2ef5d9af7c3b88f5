"""The worker's internal wire (docs/internal-api.md): generate-request validation and the NDJSON
stream chunks. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.outputs import EngineOutput
from tandem.engine.request_limits import (
    MAX_PRIORITY,
    MAX_STOP_STRINGS,
    LimitError,
    check_n,
    check_stop,
    check_stop_token_ids,
)
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams

MAX_REQUEST_ID_LEN = 256
MAX_PROMPT_TOKENS = 1 << 20
_KEYS = {
    "request_id",
    "prompt_token_ids",
    "sampling_params",
    "kv_transfer_params",
    "remote_decode",
    "priority",
    "resume_token_ids",
    "kv_prefix_params",
}


@dataclass(slots=True, frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    remote_decode: bool
    priority: int
    # Tokens generated (and delivered) elsewhere: outputs 0..k-1 here (a migrated stream).
    resume_token_ids: list[int] = field(default_factory=list)
    # A peer's grant of its cached prefix of the prompt (decode/peer.py): pull, then compute on.
    kv_prefix_params: dict[str, Any] | None = None


class BadRequest(ValueError):
    """A malformed internal request; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """The worker's waiting queue is at its bound: answered 503 with Retry-After, so a router
    that misjudged the load tries elsewhere instead of flooding this worker."""


def parse_generate_request(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = set(body) - _KEYS
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    rid = body.get("request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise BadRequest("request_id must be a non-empty string", "request_id")
    ids = body.get("prompt_token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_PROMPT_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise BadRequest(
            "prompt_token_ids must be a non-empty list of non-negative integers",
            "prompt_token_ids",
        )
    raw_params = body.get("sampling_params") or {}
    try:
        _check_limits(raw_params)
        params = SamplingParams.from_dict(raw_params)
    except LimitError as exc:
        raise BadRequest(exc.message, exc.param) from None
    except ValueError as exc:
        raise BadRequest(str(exc), "sampling_params") from None
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest("kv_transfer_params must be an object or null", "kv_transfer_params")
    remote_decode = body.get("remote_decode", False)
    if not isinstance(remote_decode, bool):
        raise BadRequest("remote_decode must be a boolean", "remote_decode")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_PRIORITY:
        raise BadRequest("priority must be an integer in [-2**31 + 1, 2**31 - 1]", "priority")
    resume = body.get("resume_token_ids") or []
    if (
        not isinstance(resume, list)
        or len(resume) > MAX_PROMPT_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in resume)
    ):
        raise BadRequest(
            "resume_token_ids must be a list of non-negative integers", "resume_token_ids"
        )
    if resume and (kv is not None or remote_decode or params.n != 1):
        raise BadRequest(
            "resume_token_ids continue a local sequence: n = 1, no kv_transfer_params and no "
            "remote_decode",
            "resume_token_ids",
        )
    if kv is not None and remote_decode:
        raise BadRequest("a request cannot both carry and produce kv_transfer_params")
    if (kv is not None or remote_decode) and params.n != 1:
        raise BadRequest("disaggregated requests take n = 1; the router fans out", "n")
    prefix = body.get("kv_prefix_params")
    if prefix is not None and not isinstance(prefix, dict):
        raise BadRequest("kv_prefix_params must be an object or null", "kv_prefix_params")
    if prefix is not None and (kv is not None or remote_decode or resume or params.n != 1):
        raise BadRequest(
            "kv_prefix_params takes n = 1, no kv_transfer_params, remote_decode or "
            "resume_token_ids",
            "kv_prefix_params",
        )
    return GenerateRequest(rid, ids, params, kv, remote_decode, priority, resume, prefix)


def parse_grant_request(body: Any) -> tuple[str, list[int]]:
    """``POST /v1/internal/kv_grant``: ``{"request_id", "prompt_token_ids"}`` (a prefix)."""
    if not isinstance(body, dict) or set(body) != {"request_id", "prompt_token_ids"}:
        raise BadRequest("kv_grant takes exactly request_id and prompt_token_ids")
    rid, ids = body["request_id"], body["prompt_token_ids"]
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise BadRequest("request_id must be a non-empty string", "request_id")
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_PROMPT_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise BadRequest(
            "prompt_token_ids must be a non-empty list of non-negative integers",
            "prompt_token_ids",
        )
    return rid, ids


def _check_limits(raw: object) -> None:
    """The router's request limits again, before SamplingParams does any per-item work (a
    request that reached the worker directly gets the same bounds: defence in depth)."""
    if not isinstance(raw, dict):
        return  # from_dict names the type error
    n = raw.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool):
        check_n(n)
    stop = raw.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            check_stop(stop)  # raises, naming the count
        check_stop([s for s in stop if isinstance(s, str)])  # from_dict names a non-string
    ids = raw.get("stop_token_ids")
    if isinstance(ids, list):
        check_stop_token_ids(ids)


def logprobs_to_wire(lp: TokenLogprobs) -> dict[str, Any]:
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "rank": lp.rank,
        "top": [[t, v] for t, v in lp.top],
    }


def encode_chunk(out: EngineOutput) -> bytes:
    """One NDJSON line of the generate stream (docs/internal-api.md)."""
    body = {
        "index": out.index,
        "token_ids": out.new_token_ids,
        "logprobs": [logprobs_to_wire(lp) for lp in out.logprobs] if out.logprobs else None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
        "error": {"message": out.error, "type": "server_error", "code": None}
        if out.error
        else None,
    }
    return json.dumps(body).encode() + b"\n"
