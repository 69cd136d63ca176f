"""The web chat page: GET / and its assets (off with --no-webui)."""

from __future__ import annotations

from quart import Quart

from serving.http.state import ServerState


def register(app: Quart, state: ServerState) -> None:
    """Adds the routes to `app` (none yet)."""
