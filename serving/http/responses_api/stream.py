"""A Responses answer from a running chat generation: whole (`collect`) or as SSE events
(`events`), both through the same `OutputBuilder`.

The stream: `response.created`, `response.in_progress`, the items' events, then
`response.completed` (or `response.incomplete` when cut by max_output_tokens or the context)
with the whole Response and its usage; an error after the stream started is
`response.failed` with the error. Every event has an increasing `sequence_number`; each is
sent as `event: <type>` and `data: <json>`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.scheduler import Finished, Token
from serving.http.errors import InternalError
from serving.http.handlers import Prepared
from serving.http.responses_api.envelope import Envelope, response_usage
from serving.http.responses_api.output import Event, OutputBuilder

log = logging.getLogger(__name__)

ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt")
"""The error codes of the spec's `ResponseError` this server may send."""


class Answer:
    """One generation's Responses answer as it is written: the builder, its status.

    deltas(event): the chat deltas of one engine event (through the request's parsers, if
    any); body(): the Response object at the end.
    """

    def __init__(self, prep: Prepared, env: Envelope, count_tokens: Callable[[str], int]):
        self.prep = prep
        self.env = env
        summary = (env.req.reasoning or {}).get("summary")
        self.builder = OutputBuilder(summary=summary in ("auto", "concise", "detailed"))
        self.status = "in_progress"
        self._count = count_tokens
        self._stream = prep.output.stream() if prep.output is not None else None

    def deltas(self, event: Any) -> list[dict[str, Any]]:
        """The chat deltas of an engine event (`Token` or `Finished`)."""
        if isinstance(event, Token):
            if self._stream is not None:
                return self._stream.feed(event.text)
            return [{"content": event.text}] if event.text else []
        if isinstance(event, Finished):
            self.status = "incomplete" if event.finish_reason == "length" else "completed"
            if self._stream is not None:
                return self._stream.finish(event.text)
            return [{"content": event.text}] if event.text else []
        return []

    def events(self, event: Any) -> list[Event]:
        """The Responses events of an engine event (the items' last ones at `Finished`)."""
        out = [e for d in self.deltas(event) for e in self.builder.feed(d)]
        if isinstance(event, Finished):
            out += self.builder.finish(self.status)
        return out

    def body(self) -> dict[str, Any]:
        """The Response object as it stands (usage once it ended)."""
        usage = None
        if self.status in ("completed", "incomplete"):
            reasoning = self.builder.reasoning
            usage = response_usage(self.prep.gen.usage(),
                                   self._count(reasoning) if reasoning else 0)
        return self.env.body(self.status, self.builder.items, usage)


async def collect(answer: Answer) -> dict[str, Any]:
    """Runs the generation to its end; the Response object (raises the first error)."""
    async for _, event in answer.prep.gen.events():
        answer.events(event)
    return answer.body()


def sse_event(event: Event) -> bytes:
    """One server-sent event: `event: <type>` and `data: <json>`."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def events(answer: Answer, done: Callable[[], None],
                 on_end: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    """The SSE body; `on_end(response)` gets the final Response (not after an error),
    `done()` runs at the end in every case."""
    prep, seq = answer.prep, 0

    def send(event: Event) -> bytes:
        nonlocal seq
        event = {**event, "sequence_number": seq}
        seq += 1
        return sse_event(event)

    try:
        yield send({"type": "response.created", "response": answer.body()})
        yield send({"type": "response.in_progress", "response": answer.body()})
        async for _, event in prep.gen.events():
            chunk = b"".join(send(e) for e in answer.events(event))
            if chunk:
                yield chunk
        final = answer.body()
        kind = "response.completed" if answer.status == "completed" else "response.incomplete"
        yield send({"type": kind, "response": final})
        prep.sent_done = True
        on_end(final)
    except Exception as e:  # every error ends the stream with response.failed
        if not isinstance(e, MetraleError):
            log.exception("response stream %s failed", answer.env.id)
            e = InternalError("internal error while streaming")
        if prep.on_error is not None:
            prep.on_error(e)
        code = e.code if e.code in ERROR_CODES else "server_error"
        answer.status = "failed"
        failed = answer.env.body("failed", answer.builder.items,
                                 error={"code": code, "message": e.message})
        yield send({"type": "response.failed", "response": failed})
        prep.sent_done = True
    finally:
        prep.gen.cancel()
        prep.gen.observe_end()
        done()
