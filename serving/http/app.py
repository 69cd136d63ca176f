"""`create_app(settings)`: the Quart app of the OpenAI-compatible server.

The routes live in serving/http/routes/, one module per API group (OpenAI's chat/completions,
completions and models; tokenize/detokenize; health, metrics and stats); here: the request
hooks (request id and `RequestContext`, body limit, multi-host followers; keys, limits and
CORS in serving/http/access.py; each request's dump, usage and log line when it ends in
serving/http/request_end.py) and the error handlers. Every answer carries `x-request-id`,
and with `--dump-requests` its sequence number `x-request-seq` (not /health nor /metrics);
every error is `{"error": {"message", "type", "param", "code"}}` (and is noted in the stats'
error log); a 405 carries `Allow`. Loading and warmup start with the app
(`before_serving`); /health is 503 until the model is ready. A multi-host follower (process
id > 0) answers only /health.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from metrale_jax.errors import MetraleError
from serving.http import access, request_end
from serving.http.bodies import error_response, json_response
from serving.http.context import RequestContext, current
from serving.http.errors import (
    InternalError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    error_body,
)
from serving.http.routes import register_all
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings
from serving.http.state import ServerState

log = logging.getLogger(__name__)

IGNORED_HEADER = "x-metrale-ignored-fields"
SEQ_HEADER = "x-request-seq"


def create_app(settings: ServerSettings, runtime: ModelRuntime | None = None) -> Quart:
    """The server's app; `runtime` may be given pre-built (tests), else it loads on startup."""
    app = Quart("metrale")
    app.config.update(MAX_CONTENT_LENGTH=settings.max_body_bytes, RESPONSE_TIMEOUT=None,
                      BODY_TIMEOUT=60, PROVIDE_AUTOMATIC_OPTIONS=True)
    state = ServerState(settings, runtime)
    app.extensions["metrale"] = state

    @app.before_serving
    async def _start() -> None:
        if state.runtime.state == "starting":
            state.runtime.start()
        state.pool.bind_loop()

    @app.after_serving
    async def _stop() -> None:
        state.pool.stop()
        if state.dumper is not None:
            state.dumper.close()
        if state.usage.usage_log is not None:
            state.usage.usage_log.close()

    @app.before_request
    async def _before() -> None:
        g.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        g.ctx = ctx = RequestContext(g.request_id, request.method, request.path)
        if state.dumper is not None and not request_end.is_probe(request.path):
            ctx.seq = state.dumper.next_seq()
        if settings.process_id != 0 and request.path != "/health":  # a multi-host follower
            raise NotFoundError(
                f"process {settings.process_id} of {settings.num_processes} of a multi-host "
                "server answers only /health; send API requests to process 0")
        length = request.content_length
        if length is not None and length > settings.max_body_bytes:
            raise PayloadTooLargeError(f"the request body has {length} bytes; the limit is "
                                       f"{settings.max_body_bytes}")

    access.install(app, state.access)  # keys, limits, CORS: after the hook above
    request_end.install(state)  # the dump, usage and log of each finished request

    @app.after_request
    async def _after(response: Response) -> Response:
        response.headers["x-request-id"] = getattr(g, "request_id", "") or uuid.uuid4().hex
        ignored = getattr(g, "ignored_fields", None)
        if ignored:
            response.headers[IGNORED_HEADER] = ", ".join(ignored)
        ctx = current()
        if ctx is not None:
            ctx.status = response.status_code
            if ctx.seq is not None:
                response.headers[SEQ_HEADER] = str(ctx.seq)
        return response

    def _record(status: int, error_type: str, message: str, code: str | None = None,
                **extra: str) -> None:
        state.errors.record(status, error_type, message, getattr(g, "request_id", None))
        ctx = current()
        if ctx is not None:
            ctx.error = {"type": error_type, "code": code, "message": message, **extra}

    def _label() -> str:
        ctx = current()
        return ctx.label() if ctx is not None else getattr(g, "request_id", "?")

    async def _keep_body() -> None:
        """A request refused before its handler read its body (401, 403, 429): the body
        is read now for its dump line (unparsable: kept as null)."""
        ctx = current()
        if ctx is None or ctx.seq is None or ctx.body is not None or request.method != "POST":
            return
        with contextlib.suppress(Exception):
            ctx.body = json.loads(await request.get_data(as_text=False))

    @app.errorhandler(MetraleError)
    async def _metrale_error(e: MetraleError) -> Response:
        if e.status != 413:
            await _keep_body()
        if e.status >= 500 and e.status != 503:
            log.error("request %s: %s", _label(), e.message)
        extra = {"limit": e.limit} if isinstance(e, RateLimitError) else {}
        _record(e.status, e.error_type, e.message, e.code, **extra)
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        _record(status, "http_error", f"{request.method} {request.path}: {e.name}",
                e.name.lower().replace(" ", "_"))
        if status == 404:
            return error_response(NotFoundError(f"no route {request.method} {request.path}"))
        if status == 405:
            response = error_response(MethodNotAllowedError(
                f"method {request.method} is not allowed on {request.path}"))
            allowed = getattr(e, "valid_methods", None) or []
            response.headers["Allow"] = ", ".join(sorted(allowed))
            return response
        if status == 413:
            return error_response(PayloadTooLargeError(
                f"the request body is over the limit of {settings.max_body_bytes} bytes"))
        kind = "invalid_request_error" if status < 500 else "server_error"
        return json_response(error_body(e.description or e.name, kind), status)

    @app.errorhandler(Exception)
    async def _bug(e: Exception) -> Response:
        log.error("request %s failed", _label(), exc_info=e)
        _record(500, "server_error", f"internal server error ({type(e).__name__})")
        return error_response(InternalError(
            f"internal server error ({type(e).__name__}); request id "
            f"{getattr(g, 'request_id', '?')}"))

    register_all(app, state)
    return app


def server_state(app: Quart) -> ServerState:
    """The `ServerState` of an app made by `create_app`."""
    return app.extensions["metrale"]
