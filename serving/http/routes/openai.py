"""OpenAI's API: POST /v1/chat/completions, POST /v1/completions (streamed as SSE or whole)
and GET /v1/models[/{id}]. The request work lives in serving/http/handlers.py; here: the
routes, and the begin/end bookkeeping of a generation around its response."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from quart import Quart, Response, g

from serving.http import handlers
from serving.http.bodies import json_response, read_body
from serving.http.errors import NotFoundError
from serving.http.protocol import ChatCompletionRequest, CompletionRequest
from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds /v1/chat/completions, /v1/completions and /v1/models[/{id}] to `app`."""

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
            return json_response(body(prep, rt))
        finally:
            prep.gen.observe_end()
            state.end()

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

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [state.runtime.model_card(),
                                                         *state.runtime.lora_cards()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        cards = {c["id"]: c for c in [state.runtime.model_card(), *state.runtime.lora_cards()]}
        if model_id not in cards:
            raise NotFoundError(f"the model {model_id!r} does not exist", code="model_not_found",
                                param="model")
        return json_response(cards[model_id])


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, callable many times, run only the first."""
    called = False

    def run() -> None:
        nonlocal called
        if not called:
            called = True
            fn()
    return run
