"""OpenAI's Responses API: POST /v1/responses (and GET /v1/responses/{id})."""

from __future__ import annotations

from quart import Quart

from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds the routes to `app` (none yet)."""
