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


MAX_DEPTH = 64
"""The deepest nesting of arrays and objects a body may have (a tool's JSON schema nests a
few levels; thousands are an attack on every recursive reader after the JSON parser)."""

MAX_SHOWN_FIELDS = 20
"""How many ignored field names the answer's header and the log line list."""


def invalid_text_field(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string of a decoded JSON body (a key or a value, depth first) that holds a
    lone UTF-16 surrogate, as (its path, e.g. "messages[1].content", the string), or None.
    JSON lets a body escape one (`"\\ud800"`); no tokenizer can encode it, so it is a 400.
    Walks without recursion; nesting deeper than `MAX_DEPTH` is an `InvalidParameterError`."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, at, depth = stack.pop()
        if isinstance(item, str):
            if lone_surrogate(item) is not None:
                return (at or "body", item)
            continue
        if depth >= MAX_DEPTH and isinstance(item, dict | list) and item:
            raise InvalidParameterError(
                f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep "
                f"(at {at or 'the top'})", param=at or None)
        if isinstance(item, dict):
            children = []
            for key, child in item.items():
                if lone_surrogate(key) is not None:
                    return (at or "body", key)
                children.append((child, f"{at}.{key}" if at else str(key), depth + 1))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]", depth + 1)
                         for i, child in reversed(list(enumerate(item))))
    return None


def shown_fields(names: list[str]) -> list[str]:
    """`names` as a header and a log line may carry them: JSON-escaped to printable ASCII (a
    client may name a field anything: a newline, a lone surrogate), the first
    `MAX_SHOWN_FIELDS`, each cut to 64 characters."""
    out = [json.dumps(n)[1:-1][:64] for n in names[:MAX_SHOWN_FIELDS]]
    if len(names) > MAX_SHOWN_FIELDS:
        out.append(f"... {len(names) - MAX_SHOWN_FIELDS} more")
    return out


async def read_body(model: type) -> Any:
    """The request's JSON body parsed into `model`; unknown fields are logged and noted."""
    data = await request.get_data(as_text=False)
    try:
        decoded = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser's own limit, some hundreds of levels
        raise InvalidParameterError(
            f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep"
        ) from None
    ctx = current()
    if ctx is not None:
        ctx.body = decoded  # for the request dump
    bad = invalid_text_field(decoded)
    if bad is not None:
        check_unicode(bad[1], param=bad[0])
    parsed = parse(model, decoded)
    unknown = shown_fields(parsed.unknown_fields())
    if unknown:
        log.info("request %s: ignoring unknown fields %s", g.request_id, ", ".join(unknown))
        g.ignored_fields = unknown
    return parsed
