"""Bounds on one request, enforced before any work starts (docs/security.md).

One definition for both places that check them: the router validates client requests against
them (an OpenAI error naming the field), and every worker re-checks its internal API against the
same numbers (defence in depth: a request that reached a worker some other way gets a 400 too).
Torch-free; the router imports it.
"""

from __future__ import annotations

MAX_N = 128  # choices of one prompt
MAX_CHOICES = 128  # prompts x n of one request: the sub-requests it fans out into
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 1024  # UTF-8 bytes of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a client request body (router --max-request-bytes)
MAX_INTERNAL_REQUEST_BYTES = 16 * 1024 * 1024  # a worker's generate body: ids, not text
MAX_CONTROL_BYTES = 64 * 1024  # every other worker-facing body (abort, heartbeat, ...)


class LimitError(ValueError):
    """A request past a limit; ``param`` names the field as the client wrote it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def check_stop(stop: list[str], param: str = "stop") -> None:
    """At most 16 stop strings of at most 1 KiB (UTF-8) each."""
    if len(stop) > MAX_STOP_STRINGS:
        raise LimitError(param, f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
    for s in stop:
        if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_STRING_BYTES:
            raise LimitError(
                param, f"each stop sequence may be at most {MAX_STOP_STRING_BYTES} bytes long"
            )


def check_n(n: int, param: str = "n") -> None:
    if n > MAX_N:
        raise LimitError(param, f"n must be at most {MAX_N}")


def check_choices(num_prompts: int, n: int, param: str = "prompt") -> None:
    """prompts x n: what one request fans out into."""
    if num_prompts * n > MAX_CHOICES:
        raise LimitError(
            param,
            f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} completions; "
            f"at most {MAX_CHOICES} are allowed per request",
        )


def check_stop_token_ids(ids: list[int], param: str = "stop_token_ids") -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise LimitError(param, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")
