"""The pooling routes: OpenAI's POST /v1/embeddings, the rerank shape of Jina and Cohere
(POST /v1/rerank, also /rerank and /v2/rerank as vLLM serves them) and vLLM's POST
/v1/score. The work is serving/http/pooling.py's; each request is counted in flight and its
usage charged to the caller's key like a generation's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from quart import Quart, Response

from serving.http import pooling
from serving.http.bodies import json_response, read_body
from serving.http.context import current
from serving.http.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds /v1/embeddings, /v1/rerank (/rerank, /v2/rerank) and /v1/score to `app`."""

    async def answer(body: Awaitable[dict[str, Any]]) -> Response:
        ctx = current()
        state.begin()
        try:
            return json_response(await body)
        finally:
            state.end()
            if ctx is not None:  # before the answer's x-ratelimit headers are written
                state.access.settle(ctx)

    def route(model: type, work: Callable[[ServerState, Any], Awaitable[dict[str, Any]]]):
        async def handler() -> Response:
            req = await read_body(model)
            return await answer(work(state, req))
        return handler

    app.add_url_rule("/v1/embeddings", "embeddings", route(EmbeddingRequest,
                                                             pooling.embeddings),
                     methods=["POST"])
    rerank = route(RerankRequest, pooling.rerank)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_url_rule(path, "rerank" + path.replace("/", "_"), rerank, methods=["POST"])
    app.add_url_rule("/v1/score", "score", route(ScoreRequest, pooling.score),
                     methods=["POST"])
