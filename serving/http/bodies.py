"""JSON in and out of a request: the helpers every route group and the app's error handlers
share. Reads the request through Quart's context; imports only the protocol, errors and
the request context (the parsed body is kept there for the request dump).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from quart import Response, g, has_request_context, request

from metrale_jax.errors import InvalidParameterError, MetraleError
from metrale_jax.text.tokenizer import check_unicode, lone_surrogate
from serving.http.context import current
from serving.http.errors import error_headers
from serving.http.protocol import parse

log = logging.getLogger(__name__)


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """`data` as a JSON response (UTF-8, not ASCII-escaped)."""
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers,
                    content_type="application/json")


ErrorShape = Callable[[MetraleError], dict[str, Any]]
"""How an API writes an error body (OpenAI's is `MetraleError.to_openai`)."""

_ERROR_SHAPES: dict[str, ErrorShape] = {}


def register_error_shape(prefix: str, shape: ErrorShape) -> None:
    """Errors of requests whose path starts with `prefix` get their body from `shape` (an API
    with its own error shape, as Anthropic's `{"type": "error", "error": {...}}`)."""
    _ERROR_SHAPES[prefix] = shape


def error_shape(path: str) -> ErrorShape | None:
    """The error shape registered for `path` (the longest prefix), or None (OpenAI's)."""
    best = max((p for p in _ERROR_SHAPES if path.startswith(p)), key=len, default=None)
    return _ERROR_SHAPES[best] if best is not None else None


def error_response(e: MetraleError) -> Response:
    """The error body of `e` in the shape of the API asked (OpenAI's unless a route group
    registered another for the path), with its status and headers (Retry-After, ...)."""
    shape = error_shape(request.path) if has_request_context() else None
    body = shape(e) if shape is not None else e.to_openai()
    return json_response(body, e.status, error_headers(e))


def invalid_text_field(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string of a decoded JSON body (a key or a value, depth first) that holds a
    lone UTF-16 surrogate, as (its path, e.g. "messages[1].content", the string), or None.
    JSON lets a body escape one (`"\\ud800"`); no tokenizer can encode it, so it is a 400."""
    if isinstance(value, str):
        return (path or "body", value) if lone_surrogate(value) is not None else None
    if isinstance(value, dict):
        for key, item in value.items():
            at = f"{path}.{key}" if path else str(key)
            if lone_surrogate(key) is not None:
                return (path or "body", key)
            if (found := invalid_text_field(item, at)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := invalid_text_field(item, f"{path}[{i}]")) is not None:
                return found
    return None


async def read_body(model: type) -> Any:
    """The request's JSON body parsed into `model`; unknown fields are logged and noted."""
    data = await request.get_data(as_text=False)
    try:
        decoded = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"the request body is not valid JSON: {e}") from None
    ctx = current()
    if ctx is not None:
        ctx.body = decoded  # for the request dump
    bad = invalid_text_field(decoded)
    if bad is not None:
        check_unicode(bad[1], param=bad[0])
    parsed = parse(model, decoded)
    unknown = parsed.unknown_fields()
    if unknown:
        log.info("request %s: ignoring unknown fields %s", g.request_id, ", ".join(unknown))
        g.ignored_fields = unknown
    return parsed
