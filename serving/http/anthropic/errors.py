"""Anthropic's error body: `{"type": "error", "error": {"type": ..., "message": ...}}`."""

from __future__ import annotations

from typing import Any

from metrale_jax.errors import MetraleError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error type of each HTTP status; other 4xx are invalid_request_error, other
5xx api_error."""


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(e: MetraleError) -> dict[str, Any]:
    """The Anthropic error body of `e` (its message; its parameter, if any, named in it)."""
    message = e.message
    param = getattr(e, "param", None)
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(e.status), "message": message}}
