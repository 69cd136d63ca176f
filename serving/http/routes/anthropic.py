"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from quart import Quart

from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds the routes to `app` (none yet)."""
