"""Operations routes: GET /health (503 until the model is ready, while draining, and while
the batching loop is unhealthy: stalled, or steps failing, with the `reason`),
GET /metrics (Prometheus), GET /v1/metrale/stats (serving/http/stats.py) and
GET /v1/metrale/usage (per-tenant usage, serving/http/usage.py). With keys, the last two need
an admin key (serving/http/access.py)."""

from __future__ import annotations

from quart import Quart, Response, request

from serving.http.bodies import json_response
from serving.http.errors import NotFoundError, error_body
from serving.http.metrics import CONTENT_TYPE
from serving.http.state import ServerState
from serving.http.stats import loop_problem, stats_body
from serving.http.usage import parse_since


def register(app: Quart, state: ServerState) -> None:
    """Adds /health, /metrics and /v1/metrale/stats to `app`."""

    @app.get("/health")
    async def health() -> Response:
        problem = loop_status(state)
        if state.pool.serving and not state.draining and problem is None:
            return json_response({"status": "ready"})
        if problem is not None and not state.draining:
            status, reason = problem
            return json_response(
                {"status": status, "reason": reason,
                 **error_body(f"the server is unhealthy: {reason}", "server_error",
                              code=status)}, 503, {"Retry-After": "5"})
        status = "draining" if state.draining else state.runtime.state
        return json_response(
            {"status": status, **error_body(f"the server is {status}", "server_error",
                                            code=status)}, 503, {"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/v1/metrale/stats")
    async def stats() -> Response:
        return json_response(stats_body(state))

    @app.get("/v1/metrale/usage")
    async def usage() -> Response:
        """Per-tenant usage: `?tenant=NAME` (default: every tenant) and `?since=TIME` (Unix
        seconds or ISO 8601; default: since the server started)."""
        since_arg = request.args.get("since")
        since = parse_since(since_arg) if since_arg else None
        known = set(state.usage.tenants())
        configured = state.access.tenants()
        if configured is not None:
            known |= set(configured)
        wanted = request.args.get("tenant")
        if wanted is not None and wanted not in known:
            raise NotFoundError(f"no tenant {wanted!r} (tenants: {sorted(known)})",
                                code="tenant_not_found", param="tenant")
        names = [wanted] if wanted is not None else sorted(known)
        figures = state.usage.query(names, since)
        return json_response({
            "object": "list", "since": since if since is not None else state.usage.started,
            "until": state.usage.clock(),
            "data": [{"object": "tenant.usage", "tenant": name, **figures[name].as_dict()}
                     for name in names]})


def loop_status(state: ServerState) -> tuple[str, str] | None:
    """(status, reason) when the primary model's batching loop is unhealthy ("stalled", or
    "failing": steps fail or the decode state is lost; `LoopHealth.problem`), else None."""
    scheduler = getattr(state.runtime, "scheduler", None)
    reason = loop_problem(scheduler)
    if reason is None:
        return None
    return ("stalled" if reason == scheduler.health.watchdog.stalled else "failing"), reason
