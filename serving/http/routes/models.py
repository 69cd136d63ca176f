"""The model pool's admin routes (serving/http/model_pool.py), admin keys only:

- GET /v1/metrale/models: every servable model with its state (on_disk, loading, loaded,
  unloading, sleeping, waking, failed), memory, requests and keep-alive;
- POST /v1/metrale/models/load, /unload, /sleep, /wake with `{"model": NAME}` (sleep: and
  `"level"` 1 or 2; load: and `"keep_alive"`), answering the model's row once done. The
  spellings of llama.cpp's router (POST /models/load, /models/unload) and vLLM's
  (POST /sleep?level=N, POST /wake_up, GET /is_sleeping; `?model=` or the primary model)
  do the same.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Quart, Response, request

from metrale_jax.errors import InvalidParameterError
from serving.http.bodies import json_response
from serving.http.model_catalog import parse_keep_alive
from serving.http.model_pool import ServedModel
from serving.http.state import ServerState


async def _body() -> dict[str, Any]:
    """The JSON object body (empty: {}), else a 400."""
    raw = await request.get_data(as_text=False)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidParameterError("the body must be a JSON object {\"model\": NAME}")
    return body


def register(app: Quart, state: ServerState) -> None:
    """Adds the model pool's admin routes to `app`."""
    pool = state.pool

    async def target(body: dict[str, Any]) -> ServedModel:
        name = body.get("model", request.args.get("model"))
        if name is not None and not isinstance(name, str):
            raise InvalidParameterError("model must be a string", param="model")
        model, _ = state.lookup_model(name)
        if name is not None and name not in pool.models:
            raise InvalidParameterError(f"{name!r} is a LoRA adapter, not a model",
                                        param="model")
        state.refuse_draining()
        return model

    @app.get("/v1/metrale/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": pool.rows()})

    @app.post("/v1/metrale/models/load")
    @app.post("/models/load")
    async def load() -> Response:
        body = await _body()
        model = await target(body)
        keep = body.get("keep_alive")
        await pool.load(model)
        if keep is not None:
            model.keep_alive = parse_keep_alive(keep)
            pool.release_idle(model)
        return json_response(model.describe())

    @app.post("/v1/metrale/models/unload")
    @app.post("/models/unload")
    async def unload() -> Response:
        model = await target(await _body())
        await pool.unload(model)
        return json_response(model.describe())

    @app.post("/v1/metrale/models/sleep")
    @app.post("/sleep")
    async def sleep() -> Response:
        body = await _body()
        level: Any = body.get("level", request.args.get("level", 1))
        try:
            level = int(level)
        except (TypeError, ValueError):
            raise InvalidParameterError("level must be 1 or 2", param="level") from None
        model = await target(body)
        await pool.sleep(model, level)
        return json_response(model.describe())

    @app.post("/v1/metrale/models/wake")
    @app.post("/wake_up")
    async def wake() -> Response:
        model = await target(await _body())
        await pool.wake(model)
        return json_response(model.describe())

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        model = await target({})
        return json_response({"is_sleeping": model.state == "sleeping", "model": model.name})
