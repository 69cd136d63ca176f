"""OpenAI's API: POST /v1/chat/completions, POST /v1/completions (streamed as SSE or whole)
and GET /v1/models[/{id}]. The request work lives in serving/http/handlers.py; here: the
routes, and the begin/end bookkeeping of a generation around its response: once its usage is
known (the JSON answer built, or its client gone) it is settled against the key's limits
(`Access.settle`); a stream's end (its last event sent, or its client gone) finishes its
`RequestContext` (`Access.finish`), the app's teardown finishes the others. /v1/models
lists only what the caller's key may use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from quart import Quart, Response, g

from serving.http import handlers
from serving.http.bodies import json_response, read_body
from serving.http.context import current
from serving.http.errors import NotFoundError
from serving.http.protocol import ChatCompletionRequest, CompletionRequest
from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds /v1/chat/completions, /v1/completions and /v1/models[/{id}] to `app`."""

    async def _generate(prep: handlers.Prepared, body, stream) -> Response:
        rt = state.runtime
        ctx = current()
        state.begin()
        if ctx is not None:
            ctx.outcome = lambda: handlers.outcome(prep)
        if prep.stream:
            rid = g.request_id

            def on_error(e) -> None:  # an error sent as a stream event
                state.errors.record(e.status, e.error_type, e.message, rid)
                if ctx is not None:
                    ctx.error = {"type": e.error_type, "code": e.code, "message": e.message}

            prep.on_error = on_error
            if ctx is not None:
                ctx.deferred = True  # the stream's end finishes it, not the handler's
                ctx.stream = True

            def end() -> None:
                state.end()
                if ctx is not None:
                    ctx.stream_done = prep.sent_done
                    state.access.finish(ctx)

            done = _once(end)
            # The task that sends the body also ran this handler: if the client leaves before
            # the body starts, the generator never runs, so its end is tied to the task too.
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(lambda _: (prep.gen.cancel(), done()))
            return Response(stream(prep, rt, done), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        try:
            await handlers.collect(prep)
            return json_response(body(prep, rt))
        finally:
            prep.gen.observe_end()
            state.end()
            if ctx is not None:  # before the answer's x-ratelimit headers are written
                state.access.settle(ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await read_body(ChatCompletionRequest)
        prep = await handlers.prepare_chat(state, req, g.request_id)
        return await _generate(prep, handlers.chat_body, handlers.chat_stream)

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await read_body(CompletionRequest)
        prep = handlers.prepare_completion(state, req, g.request_id)
        return await _generate(prep, handlers.completion_body, handlers.completion_stream)

    def cards() -> list[dict]:
        """The cards of the models the caller may use (the base model first)."""
        base = state.runtime.model_card()
        out = [base] if state.access.visible_model(base["id"], is_adapter=False) else []
        return out + [c for c in state.runtime.lora_cards()
                      if state.access.visible_model(c["id"], is_adapter=True)]

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": cards()})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        cards_by_id = {c["id"]: c for c in cards()}
        if model_id not in cards_by_id:
            raise NotFoundError(f"the model {model_id!r} does not exist", code="model_not_found",
                                param="model")
        return json_response(cards_by_id[model_id])


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, callable many times, run only the first."""
    called = False

    def run() -> None:
        nonlocal called
        if not called:
            called = True
            fn()
    return run
