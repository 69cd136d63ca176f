"""The LoRA routes.

vLLM's: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
{"lora_name"}, refused (400) unless the server was started with `--enable-lora-runtime-updates`.
A loaded adapter is served as model `lora_name` at once and listed by /v1/models; unloading
refuses new requests for it at once and answers when the requests already using it have ended
(their answers complete).

llama.cpp's: GET /lora-adapters lists the loaded adapters ({"id", "name", "path", "scale"});
POST /lora-adapters [{"id", "scale"}, ...] sets the active adapters' scales (an adapter not
listed gets 0), which is what a request that names no adapter (by `model` or `lora`) is served
with. Requests already queued keep what they were given.

With API keys, loading, unloading and setting the scales need an admin key
(serving/http/access.py); GET /lora-adapters lists the adapters the caller's key may use."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from pydantic import Field
from quart import Quart, Response, request

from metrale_jax.errors import InvalidParameterError
from serving.http.bodies import json_response, read_body
from serving.http.protocol import LoraScale, RequestBody, lora_weights, parse
from serving.http.state import ServerState


class LoadLoraRequest(RequestBody):
    """The body of POST /v1/load_lora_adapter."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraRequest(RequestBody):
    """The body of POST /v1/unload_lora_adapter."""

    lora_name: Annotated[str, Field(min_length=1)]


class LoraScales(RequestBody):
    """The body of POST /lora-adapters (a JSON list, read into `lora`)."""

    lora: list[LoraScale]


def register(app: Quart, state: ServerState) -> None:
    """Adds /v1/load_lora_adapter, /v1/unload_lora_adapter and /lora-adapters to `app`."""

    def runtime_updates() -> None:
        if not state.settings.enable_lora_runtime_updates:
            raise InvalidParameterError(
                "loading and unloading LoRA adapters at runtime is off: start the server "
                "with --enable-lora-runtime-updates", param=None)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        runtime_updates()
        req = await read_body(LoadLoraRequest)
        rt = state.require_ready()
        if req.lora_name == state.settings.model_name:
            raise InvalidParameterError(f"{req.lora_name!r} is the base model's name",
                                        param="lora_name")
        from metrale_jax.weights.lora import load_peft_adapter
        adapter = await asyncio.to_thread(load_peft_adapter, req.lora_path,
                                          rt.checkpoint.config, req.lora_name,
                                          rt.engine_config.max_lora_rank)
        await asyncio.wrap_future(rt.scheduler.load_lora(req.lora_name, adapter))
        rt.lora_paths[req.lora_name] = req.lora_path
        return json_response({"object": "lora_adapter", "lora_name": req.lora_name,
                              "status": "loaded"})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        runtime_updates()
        req = await read_body(UnloadLoraRequest)
        rt = state.require_ready()
        await asyncio.wrap_future(rt.scheduler.unload_lora(req.lora_name))
        rt.lora_paths.pop(req.lora_name, None)
        return json_response({"object": "lora_adapter", "lora_name": req.lora_name,
                              "status": "unloaded"})

    @app.get("/lora-adapters")
    async def lora_adapters() -> Response:
        return json_response([a for a in state.require_ready().lora_adapters()
                              if state.access.visible_adapter(a["name"])])

    @app.post("/lora-adapters")
    async def set_lora_scales() -> Response:
        rt = state.require_ready()
        try:
            body = json.loads(await request.get_data(as_text=False))
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidParameterError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, list):
            raise InvalidParameterError('the body must be a JSON list of {"id", "scale"}',
                                        param="lora")
        scales = parse(LoraScales, {"lora": body}).lora
        rt.scheduler.set_active_lora(lora_weights(scales, rt.lora_ids()))
        return json_response({"success": True})
