"""OpenAI's API: POST /v1/chat/completions, POST /v1/completions (streamed as SSE or whole)
and GET /v1/models[/{id}]. The request work lives in serving/http/handlers.py; here: the
routes; the bookkeeping around a generation's answer is serving/http/answers.py's. /v1/models
lists only what the caller's key may use."""

from __future__ import annotations

from quart import Quart, Response, g

from serving.http import handlers
from serving.http.answers import stream_answer, whole_answer
from serving.http.bodies import json_response, read_body
from serving.http.errors import NotFoundError
from serving.http.protocol import ChatCompletionRequest, CompletionRequest
from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds /v1/chat/completions, /v1/completions and /v1/models[/{id}] to `app`."""

    async def _generate(prep: handlers.Prepared, body, stream) -> Response:
        rt = prep.gen.runtime
        if prep.stream:
            return stream_answer(state, prep, g.request_id,
                                 lambda done: stream(prep, rt, done))

        async def produce() -> Response:
            await handlers.collect(prep)
            return json_response(body(prep, rt))
        return await whole_answer(state, prep, produce)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await read_body(ChatCompletionRequest)
        prep = await handlers.prepare_chat(state, req, g.request_id)
        return await _generate(prep, handlers.chat_body, handlers.chat_stream)

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await read_body(CompletionRequest)
        prep = await handlers.prepare_completion(state, req, g.request_id)
        return await _generate(prep, handlers.completion_body, handlers.completion_stream)

    def cards() -> list[dict]:
        """The cards of the models the caller may use (the primary model first, its LoRA
        adapters last), each with its `state` in the model pool (loaded, on_disk, ...)."""
        out = []
        for served in state.pool.models.values():
            if not state.access.visible_model(served.name, is_adapter=False):
                continue
            rt = served.runtime
            if rt.ready or served.primary:
                card = rt.model_card()
            else:  # not loaded: what is known without reading it
                card = {"id": served.name, "object": "model", "created": rt.created,
                        "owned_by": "metrale", "root": str(served.settings.model),
                        "parent": None}
            out.append({**card, "state": served.state})
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

