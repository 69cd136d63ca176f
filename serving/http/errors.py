"""Server-only errors and the OpenAI error body.

Every error answer is `{"error": {"message", "type", "param", "code"}}`; user errors from the
layers below are `MetraleError`s already and keep their status and type.
"""

from __future__ import annotations

import math

from metrale_jax.errors import MetraleError


class ServerError(MetraleError):
    """Base of the errors only the HTTP layer raises."""


class NotFoundError(ServerError):
    """No such route or object (404)."""

    status = 404


class MethodNotAllowedError(ServerError):
    """The route exists but not for this method (405)."""

    status = 405


class PayloadTooLargeError(ServerError):
    """The request body is over `max_body_bytes` (413)."""

    status = 413


class AuthenticationError(ServerError):
    """A missing or wrong API key (401)."""

    status = 401
    error_type = "authentication_error"

    def __init__(self, message: str = "invalid or missing API key"):
        super().__init__(message, code="invalid_api_key")


class PermissionDeniedError(ServerError):
    """A valid key without the right (an admin route with a key that is not admin's): 403."""

    status = 403
    error_type = "permission_error"

    def __init__(self, message: str):
        super().__init__(message, code="permission_denied")


class RateLimitError(ServerError):
    """Over a key's limit (429 with Retry-After; serving/http/limits.py). `limit` names which:
    "requests" (per minute), "tokens" (per minute), "concurrent" or "daily_tokens"."""

    status = 429
    error_type = "rate_limit_error"
    LIMITS = ("requests", "tokens", "concurrent", "daily_tokens")

    def __init__(self, message: str, retry_after: float, limit: str = "requests"):
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after = retry_after
        self.limit = limit


class UnavailableError(ServerError):
    """Not ready (loading, warming up), draining, or stopping (503 with Retry-After)."""

    status = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str = "unavailable"):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class RequestTimeoutError(ServerError):
    """The request's deadline passed before it finished (408, not retried by clients)."""

    status = 408
    error_type = "timeout_error"

    def __init__(self, message: str):
        super().__init__(message, code="timeout")


class InternalError(ServerError):
    """A bug: answered 500 in the OpenAI shape, logged with the request id."""

    status = 500
    error_type = "server_error"


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_headers(error: MetraleError) -> dict[str, str]:
    """Extra headers of an error answer: Retry-After for 503s and 429s (a 429 also in
    milliseconds, `retry-after-ms`, which the openai client reads first), no-retry for
    timeouts."""
    headers = {}
    retry_after = getattr(error, "retry_after", None)
    if retry_after is not None:
        retry_after = round(retry_after, 6)  # float noise must not round 20 s up to 21
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        if isinstance(error, RateLimitError):
            headers["retry-after-ms"] = str(max(1, math.ceil(retry_after * 1000)))
    if isinstance(error, RequestTimeoutError):
        headers["x-should-retry"] = "false"
    return headers
