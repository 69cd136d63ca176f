"""vLLM's utility routes: POST /tokenize (a prompt, or messages through the chat template; a
vision-language model's image parts count as their placeholder runs, unloaded) and
POST /detokenize."""

from __future__ import annotations

from quart import Quart, Response

from metrale_jax.errors import InvalidParameterError
from serving.http import vision
from serving.http.bodies import json_response, read_body
from serving.http.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds /tokenize and /detokenize to `app`."""

    @app.post("/tokenize")
    async def tokenize() -> Response:
        req = await read_body(TokenizeRequest)
        rt, _ = await state.use_model(req.model, keep_alive=req.keep_alive)
        if req.messages is not None:
            chat = parse(ChatCompletionRequest, {"messages": req.messages})  # [] is a 400
            if rt.vision is not None:  # each image part counts as its placeholder run
                ids = vision.tokenize_chat(rt, chat, req.add_generation_prompt,
                                           bool(req.add_special_tokens))
            else:
                vision.refuse_images(chat, rt.settings.model_name)
                text = rt.render_chat(chat.template_messages(),
                                      add_generation_prompt=req.add_generation_prompt)
                ids = rt.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = rt.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
                raise InvalidParameterError("give a prompt or messages", param="prompt")
        strs = [rt.token_str(i) for i in ids] if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": rt.max_len, "tokens": ids,
                              "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        req = await read_body(DetokenizeRequest)
        rt, _ = await state.use_model(req.model, keep_alive=req.keep_alive)
        vocab = rt.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
                raise InvalidParameterError(f"token ids must be in [0, {vocab})", param="tokens")
        return json_response({"prompt": rt.decode(req.tokens, skip_special_tokens=False)})
