"""The web chat page: GET / and its assets under /webui/<name> (off with --no-webui).

The page (serving/http/webui/: index.html, app.js, style.css, shipped as package data) is
static: it calls the server's own API from the browser (GET /v1/models, POST
/v1/chat/completions with `stream: true`). Its routes need no API key (serving/http/access.py
opens them while the page is on); the page asks for a key when the API answers 401 and sends it
as `Authorization: Bearer`. With `--no-webui` nothing is registered, so `GET /` is the
API's ordinary 404.
"""

from __future__ import annotations

from importlib import resources

from quart import Quart, Response

from serving.http.errors import NotFoundError
from serving.http.state import ServerState

ASSETS = {"index.html": "text/html; charset=utf-8",
          "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
# The page loads nothing from elsewhere and runs no inline code; images are the user's own
# attachments (data: URLs).
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def read_asset(name: str) -> bytes:
    """The bytes of the page's asset `name` (one of `ASSETS`) from the package data;
    `NotFoundError` for any other name."""
    if name not in ASSETS:
        raise NotFoundError(f"no web page asset {name!r}")
    return resources.files("serving.http").joinpath("webui", name).read_bytes()


def asset_response(name: str) -> Response:
    """The asset `name` as a response, with its content type and the page's headers."""
    return Response(read_asset(name), content_type=ASSETS[name], headers={
        "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": POLICY, "Referrer-Policy": "no-referrer"})


def register(app: Quart, state: ServerState) -> None:
    """Adds `GET /` (the page) and `GET /webui/<name>` (its assets) to `app`, unless the
    server runs with `--no-webui` (`state.settings.webui` False)."""
    if not state.settings.webui:
        return

    @app.get("/")
    async def webui_page() -> Response:
        return asset_response("index.html")

    @app.get("/webui/<name>")
    async def webui_asset(name: str) -> Response:
        return asset_response(name)
