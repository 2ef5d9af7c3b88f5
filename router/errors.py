"""OpenAI-format errors raised anywhere in the router and rendered by the app's handler.

Every client-visible failure is an ``OpenAIError``: the handler in ``app.py`` turns it into
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status, so bad input
never surfaces as a 500.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """A failure to report to the client; ``status`` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def no_workers(pool: str) -> OpenAIError:
    return OpenAIError(
        503, f"No healthy {pool} worker is registered; try again shortly.", code="no_workers"
    )
