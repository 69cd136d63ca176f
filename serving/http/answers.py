"""The bookkeeping around a submitted generation's answer, shared by every API front (OpenAI's
chat and completions, the Responses API, Anthropic's Messages).

`whole_answer` runs a generation to its end and returns the body its API builds;
`stream_answer` returns the SSE response whose body its API writes. Both count the request in
flight (`ServerState.begin`/`end`), give the request's context its outcome (for the request
dump), and charge its usage to the key's limits once known (`Access.settle`: before a whole
answer's `x-ratelimit-*` headers are written). A stream's end (its last event sent, or its
client gone, also before the body started) finishes the context (`Access.finish`) once; the
app's teardown finishes the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from quart import Response

from metrale_jax.errors import MetraleError
from serving.http.context import RequestContext, current
from serving.http.handlers import Prepared, outcome
from serving.http.state import ServerState

T = TypeVar("T")


def _begin(state: ServerState, prep: Prepared) -> RequestContext | None:
    ctx = current()
    state.begin()
    if ctx is not None:
        ctx.outcome = lambda: outcome(prep)
    return ctx


async def whole_answer(state: ServerState, prep: Prepared,
                       produce: Callable[[], Awaitable[T]]) -> T:
    """Awaits `produce()` (which runs the generation to its end and builds the answer's body)
    with the request's bookkeeping around it; returns what it returns."""
    ctx = _begin(state, prep)
    try:
        return await produce()
    finally:
        prep.gen.observe_end()
        state.end()
        if ctx is not None:  # before the answer's x-ratelimit headers are written
            state.access.settle(ctx)


def stream_answer(state: ServerState, prep: Prepared, request_id: str,
                  events: Callable[[Callable[[], None]], AsyncIterator[bytes]]) -> Response:
    """The `text/event-stream` response of `events(done)`, an async iterator of SSE bytes that
    calls `done()` when it ends (the one given here: it may be called more than once).
    Errors the body sends as events go to the stats' error log and the request's context
    through `prep.on_error`."""
    ctx = _begin(state, prep)

    def on_error(e: MetraleError) -> None:  # an error sent as a stream event
        state.errors.record(e.status, e.error_type, e.message, request_id)
        if ctx is not None:
            ctx.error = {"type": e.error_type, "code": e.code, "message": e.message}

    prep.on_error = on_error
    if ctx is not None:
        ctx.deferred = True  # the stream's end finishes it, not the handler's
        ctx.stream = True
    ended = False

    def done() -> None:
        nonlocal ended
        if ended:
            return
        ended = True
        state.end()
        if ctx is not None:
            ctx.stream_done = prep.sent_done
            state.access.finish(ctx)

    # The task that sends the body also ran the handler: if the client leaves before the body
    # starts, the body never runs, so the end is tied to the task too.
    task = asyncio.current_task()
    if task is not None:
        task.add_done_callback(lambda _: (prep.gen.cancel(), done()))
    return Response(events(done), content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"})
