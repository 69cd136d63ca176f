"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and
POST /v1/messages/count_tokens.

A request becomes a chat request (serving/http/anthropic/protocol.py) prepared and submitted
as /v1/chat/completions does it (`handlers.prepare_chat`); its answer is written as
Anthropic content blocks (anthropic/output.py, anthropic/stream.py) with chat's bookkeeping
around it (serving/http/answers.py). Every error on these paths has Anthropic's shape
(anthropic/errors.py).
"""

from __future__ import annotations

from quart import Quart, Response, g

from metrale_jax.errors import MetraleError
from serving.http import handlers, vision
from serving.http.answers import stream_answer, whole_answer
from serving.http.anthropic import stream as messages_stream
from serving.http.anthropic.errors import error_body
from serving.http.anthropic.output import Answer, message_body
from serving.http.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    messages_param,
)
from serving.http.bodies import json_response, read_body, register_error_shape
from serving.http.state import ServerState

PREFIX = "/v1/messages"


def register(app: Quart, state: ServerState) -> None:
    """Adds POST /v1/messages and /v1/messages/count_tokens to `app`; errors on them get
    Anthropic's shape."""
    register_error_shape(PREFIX, error_body)

    @app.post(PREFIX)
    async def create_message() -> Response:
        req = await read_body(MessagesRequest)
        try:
            prep = await handlers.prepare_chat(state, req.chat_request(), g.request_id)
        except MetraleError as e:  # named as the Messages request names it
            e.param = messages_param(e.param)
            raise
        answer = Answer(prep, req.model, req.stop_sequences)
        if req.stream:
            return stream_answer(state, prep, g.request_id,
                                 lambda done: messages_stream.events(answer, done))

        async def produce() -> Response:
            await handlers.collect(prep)
            return json_response(message_body(answer))
        return await whole_answer(state, prep, produce)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens() -> Response:
        req = await read_body(CountTokensRequest)
        chat = req.chat_request()
        rt, _ = await state.use_model(chat.model, keep_alive=req.keep_alive)
        chat.validate_semantics()
        render = dict(add_generation_prompt=True, tools=chat.tools, **chat.template_kwargs())
        if rt.vision is None:
            vision.refuse_images(chat, rt.settings.model_name)
            prompt = rt.encode_chat(chat.template_messages(), **render)
        else:
            prompt, _ = await vision.chat_prompt(rt, chat, **render)
        return json_response({"input_tokens": len(prompt)})
