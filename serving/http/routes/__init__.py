"""The API's routes, one module per API group, each with a `register(app, state)`: `openai`
(chat/completions, completions, models), `tokenize` (/tokenize, /detokenize), `admin`
(/health, /metrics, /v1/metrale/stats), `lora` (vLLM's runtime adapter loading), `models` (the
model pool's load, unload, sleep and wake),
`openai_responses` (OpenAI's Responses API), `anthropic` (Anthropic's Messages API), `pooling`
(embeddings, rerank and score), `webui` (the web chat page). A new API is a new module here,
added to `GROUPS`.
Routes may import the rest of serving.http, never app.py (which imports them).
"""

from __future__ import annotations

from quart import Quart

from serving.http.routes import (
    admin,
    anthropic,
    lora,
    models,
    openai,
    openai_responses,
    pooling,
    tokenize,
    webui,
)
from serving.http.state import ServerState

GROUPS = (openai, tokenize, admin, lora, models, openai_responses, anthropic, pooling, webui)


def register_all(app: Quart, state: ServerState) -> None:
    """Adds every group's routes to `app`."""
    for group in GROUPS:
        group.register(app, state)

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax", "serving.http")
