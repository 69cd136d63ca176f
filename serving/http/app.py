"""`create_app(settings)`: the Quart app of the OpenAI-compatible server.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics, GET /v1/metrale/stats (serving/http/stats.py), POST /tokenize, POST /detokenize.
Every answer carries `x-request-id`; every error is `{"error": {"message", "type", "param",
"code"}}` (and is noted in the stats' error log). Loading and warmup start with the app
(`before_serving`); /health is 503 until the model is ready. A multi-host follower (process
id > 0) answers only /health.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from metrale_jax.errors import InvalidParameterError, MetraleError
from serving.http import handlers
from serving.http.errors import (
    AuthenticationError,
    InternalError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    error_body,
    error_headers,
)
from serving.http.metrics import CONTENT_TYPE
from serving.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings
from serving.http.state import ServerState
from serving.http.stats import stats_body

log = logging.getLogger(__name__)

PROTECTED = ("/v1/", "/tokenize", "/detokenize")
IGNORED_HEADER = "x-metrale-ignored-fields"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers,
                    content_type="application/json")


def _error(e: MetraleError) -> Response:
    return _json(e.to_openai(), e.status, error_headers(e))


async def _body(model: type) -> Any:
    """The request's JSON body parsed into `model`; unknown fields are logged and noted."""
    data = await request.get_data(as_text=False)
    try:
        decoded = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"the request body is not valid JSON: {e}") from None
    parsed = parse(model, decoded)
    unknown = parsed.unknown_fields()
    if unknown:
        log.info("request %s: ignoring unknown fields %s", g.request_id, ", ".join(unknown))
        g.ignored_fields = unknown
    return parsed


def create_app(settings: ServerSettings, runtime: ModelRuntime | None = None) -> Quart:
    """The server's app; `runtime` may be given pre-built (tests), else it loads on startup."""
    app = Quart("metrale")
    app.config.update(MAX_CONTENT_LENGTH=settings.max_body_bytes, RESPONSE_TIMEOUT=None,
                      BODY_TIMEOUT=60, PROVIDE_AUTOMATIC_OPTIONS=False)
    state = ServerState(settings, runtime)
    app.extensions["metrale"] = state

    @app.before_serving
    async def _start() -> None:
        if state.runtime.state == "starting":
            state.runtime.start()

    @app.after_serving
    async def _stop() -> None:
        state.runtime.stop()

    @app.before_request
    async def _before() -> None:
        g.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if settings.process_id != 0 and request.path != "/health":  # a multi-host follower
            raise NotFoundError(
                f"process {settings.process_id} of {settings.num_processes} of a multi-host "
                "server answers only /health; send API requests to process 0")
        length = request.content_length
        if length is not None and length > settings.max_body_bytes:
            raise PayloadTooLargeError(f"the request body has {length} bytes; the limit is "
                                       f"{settings.max_body_bytes}")
        if settings.api_key and request.path.startswith(PROTECTED):
            auth = request.headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    key.strip().encode(), settings.api_key.encode()):
                raise AuthenticationError()

    @app.after_request
    async def _after(response: Response) -> Response:
        response.headers["x-request-id"] = getattr(g, "request_id", "") or uuid.uuid4().hex
        ignored = getattr(g, "ignored_fields", None)
        if ignored:
            response.headers[IGNORED_HEADER] = ", ".join(ignored)
        return response

    def _record(status: int, error_type: str, message: str) -> None:
        state.errors.record(status, error_type, message, getattr(g, "request_id", None))

    @app.errorhandler(MetraleError)
    async def _metrale_error(e: MetraleError) -> Response:
        if e.status >= 500 and e.status != 503:
            log.error("request %s: %s", getattr(g, "request_id", "?"), e.message)
        _record(e.status, e.error_type, e.message)
        return _error(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        _record(status, "http_error", f"{request.method} {request.path}: {e.name}")
        if status == 404:
            return _error(NotFoundError(f"no route {request.method} {request.path}"))
        if status == 405:
            return _error(MethodNotAllowedError(
                f"method {request.method} is not allowed on {request.path}"))
        if status == 413:
            return _error(PayloadTooLargeError(
                f"the request body is over the limit of {settings.max_body_bytes} bytes"))
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _json(error_body(e.description or e.name, kind), status)

    @app.errorhandler(Exception)
    async def _bug(e: Exception) -> Response:
        log.error("request %s failed", getattr(g, "request_id", "?"), exc_info=e)
        _record(500, "server_error", f"internal server error ({type(e).__name__})")
        return _error(InternalError(f"internal server error ({type(e).__name__}); request id "
                                    f"{getattr(g, 'request_id', '?')}"))

    async def _generate(prep: handlers.Prepared, body, stream) -> Response:
        rt = state.runtime
        state.begin()
        if prep.stream:
            rid = g.request_id
            prep.on_error = lambda e: state.errors.record(e.status, e.error_type, e.message, rid)
            done = _once(state.end)
            # The task that sends the body also ran this handler: if the client leaves before
            # the body starts, the generator never runs, so its end is tied to the task too.
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(lambda _: (prep.gen.cancel(), done()))
            return Response(stream(prep, rt, done), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        try:
            await handlers.collect(prep)
            return _json(body(prep, rt))
        finally:
            prep.gen.observe_end()
            state.end()

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await _body(ChatCompletionRequest)
        prep = handlers.prepare_chat(state, req, g.request_id)
        return await _generate(prep, handlers.chat_body, handlers.chat_stream)

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await _body(CompletionRequest)
        prep = handlers.prepare_completion(state, req, g.request_id)
        return await _generate(prep, handlers.completion_body, handlers.completion_stream)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [state.runtime.model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != settings.model_name:
            raise NotFoundError(f"the model {model_id!r} does not exist", code="model_not_found",
                                param="model")
        return _json(state.runtime.model_card())

    @app.get("/health")
    async def health() -> Response:
        rt = state.runtime
        if rt.ready and not state.draining:
            return _json({"status": "ready"})
        status = "draining" if state.draining else rt.state
        return _json({"status": status, **error_body(f"the server is {status}", "server_error",
                                                     code=status)}, 503, {"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/v1/metrale/stats")
    async def stats() -> Response:
        return _json(stats_body(state))

    @app.post("/tokenize")
    async def tokenize() -> Response:
        req = await _body(TokenizeRequest)
        rt = state.require_ready()
        state.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text = rt.render_chat(chat.template_messages(),
                                  add_generation_prompt=req.add_generation_prompt)
            ids = rt.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = rt.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
                raise InvalidParameterError("give a prompt or messages", param="prompt")
        strs = [rt.token_str(i) for i in ids] if req.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": rt.max_len, "tokens": ids,
                      "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        req = await _body(DetokenizeRequest)
        rt = state.require_ready()
        state.check_model(req.model)
        vocab = rt.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
                raise InvalidParameterError(f"token ids must be in [0, {vocab})", param="tokens")
        return _json({"prompt": rt.decode(req.tokens, skip_special_tokens=False)})

    return app


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, callable many times, run only the first."""
    called = False

    def run() -> None:
        nonlocal called
        if not called:
            called = True
            fn()
    return run


def server_state(app: Quart) -> ServerState:
    """The `ServerState` of an app made by `create_app`."""
    return app.extensions["metrale"]
