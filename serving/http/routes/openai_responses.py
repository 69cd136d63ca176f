"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE
/v1/responses/{id}.

A request becomes a chat request (serving/http/responses_api/protocol.py) prepared and
submitted as /v1/chat/completions does it (`handlers.prepare_chat`); its answer is written as
Responses output items (responses_api/stream.py), with chat's bookkeeping around it
(serving/http/answers.py). Responses with `store` (the default) are kept
in a bounded in-memory store for `previous_response_id` and GET, each
visible only to its caller's tenant (or key).
"""

from __future__ import annotations

from typing import Any

from quart import Quart, Response, g

from metrale_jax.errors import InvalidParameterError, MetraleError
from serving.http import handlers
from serving.http.answers import stream_answer, whole_answer
from serving.http.bodies import json_response, read_body
from serving.http.context import current
from serving.http.errors import NotFoundError
from serving.http.responses_api import stream as responses_stream
from serving.http.responses_api.envelope import Envelope
from serving.http.responses_api.output import new_id
from serving.http.responses_api.protocol import CreateResponseRequest, responses_param
from serving.http.responses_api.store import ResponseStore, Stored
from serving.http.state import ServerState

STORE_CAPACITY = 256
"""How many responses the in-memory store keeps (least recently used out first)."""


def register(app: Quart, state: ServerState) -> None:
    """Adds POST /v1/responses and GET / DELETE /v1/responses/{id} to `app`."""
    store = ResponseStore(STORE_CAPACITY)

    def owner() -> str | None:
        """Who the caller is to the store: its key's tenant, else its key's name."""
        ctx = current()
        return (ctx.tenant or ctx.key_name) if ctx is not None else None

    def history(req: CreateResponseRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        stored = store.get(req.previous_response_id, owner())
        if stored is None:
            raise InvalidParameterError(
                f"no stored response has id {req.previous_response_id!r} (responses are kept "
                f"in memory, the last {STORE_CAPACITY}, only with store true)",
                param="previous_response_id")
        return stored.items

    @app.post("/v1/responses")
    async def create_response() -> Response:
        req = await read_body(CreateResponseRequest)
        req.check()
        earlier = history(req)
        try:
            chat = req.chat_request(earlier)
            prep = await handlers.prepare_chat(state, chat, g.request_id)
        except MetraleError as e:  # named as the Responses request names it
            e.param = responses_param(e.param)
            raise
        rt = prep.gen.runtime
        env = Envelope(new_id("resp"), req, rt.settings.model_name)
        answer = responses_stream.Answer(
            prep, env, lambda text: len(rt.tokenizer.encode(text, add_special_tokens=False)))
        items, who = [*earlier, *req.input_items()], owner()

        def keep(body: dict[str, Any]) -> None:
            if req.store:
                store.put(Stored(body, [*items, *body["output"]], who))

        if req.stream:
            return stream_answer(state, prep, g.request_id,
                                 lambda done: responses_stream.events(answer, done, keep))
        body = await whole_answer(state, prep, lambda: responses_stream.collect(answer))
        keep(body)
        return json_response(body)

    def stored(response_id: str) -> Stored:
        found = store.get(response_id, owner())
        if found is None:
            raise NotFoundError(f"no stored response has id {response_id!r}",
                                code="response_not_found", param="response_id")
        return found

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        return json_response(stored(response_id).response)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        stored(response_id)
        store.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})
