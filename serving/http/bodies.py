"""JSON in and out of a request: the helpers every route group and the app's error handlers
share. Reads the request through Quart's context; imports only the protocol, errors and
the request context (the parsed body is kept there for the request dump).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Response, g, request

from metrale_jax.errors import InvalidParameterError, MetraleError
from serving.http.context import current
from serving.http.errors import error_headers
from serving.http.protocol import parse

log = logging.getLogger(__name__)


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """`data` as a JSON response (UTF-8, not ASCII-escaped)."""
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers,
                    content_type="application/json")


def error_response(e: MetraleError) -> Response:
    """The OpenAI error body of `e`, with its status and headers (Retry-After, ...)."""
    return json_response(e.to_openai(), e.status, error_headers(e))


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
    parsed = parse(model, decoded)
    unknown = parsed.unknown_fields()
    if unknown:
        log.info("request %s: ignoring unknown fields %s", g.request_id, ", ".join(unknown))
        g.ignored_fields = unknown
    return parsed
