"""Operations routes: GET /health (503 until the model is ready, and while draining),
GET /metrics (Prometheus) and GET /v1/metrale/stats (serving/http/stats.py)."""

from __future__ import annotations

from quart import Quart, Response

from serving.http.bodies import json_response
from serving.http.errors import error_body
from serving.http.metrics import CONTENT_TYPE
from serving.http.state import ServerState
from serving.http.stats import stats_body


def register(app: Quart, state: ServerState) -> None:
    """Adds /health, /metrics and /v1/metrale/stats to `app`."""

    @app.get("/health")
    async def health() -> Response:
        rt = state.runtime
        if rt.ready and not state.draining:
            return json_response({"status": "ready"})
        status = "draining" if state.draining else rt.state
        return json_response(
            {"status": status, **error_body(f"the server is {status}", "server_error",
                                            code=status)}, 503, {"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/v1/metrale/stats")
    async def stats() -> Response:
        return json_response(stats_body(state))
