"""The streamed Messages answer: Anthropic's SSE events (`event: <type>` and `data: <json>`).

message_start, then each content block's content_block_start / content_block_delta
(text_delta, thinking_delta, input_json_delta) / content_block_stop, then message_delta
(stop_reason, stop_sequence, usage.output_tokens) and message_stop. An error after the stream
started is an `error` event (Anthropic's error body), and the stream ends there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.scheduler import Finished, Token
from serving.http.anthropic.errors import error_body
from serving.http.anthropic.output import Answer, Blocks
from serving.http.errors import InternalError

log = logging.getLogger(__name__)


def event(data: dict[str, Any]) -> bytes:
    """One SSE event named by its `type`."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {data['type']}\ndata: {text}\n\n".encode()


async def events(answer: Answer, done: Callable[[], None]) -> AsyncIterator[bytes]:
    """The SSE body of `answer`'s stream; calls `done()` at its end."""
    prep = answer.prep
    gen = prep.gen
    try:
        usage = answer.usage()
        yield event({"type": "message_start", "message": answer.envelope(
            [], None, None, {**usage, "output_tokens": 0})})
        yield event({"type": "ping"})
        shaper = answer.stream()
        blocks = Blocks()
        async for _, ev in gen.events():
            if isinstance(ev, Token):
                chat = shaper.feed(ev.text) if shaper else [{"content": ev.text}]
            elif isinstance(ev, Finished):
                chat = shaper.finish(ev.text) if shaper else [{"content": ev.text}]
            else:
                continue
            for d in chat:
                for e in blocks.feed(d):
                    yield event(e)
        for e in blocks.close():
            yield event(e)
        reason, sequence = answer.stop(shaper is not None and shaper.called)
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": answer.usage()})
        yield event({"type": "message_stop"})
        prep.sent_done = True
    except MetraleError as e:
        if prep.on_error is not None:
            prep.on_error(e)
        yield event(error_body(e))
        prep.sent_done = True
    except Exception:
        log.exception("stream %s failed", answer.id)
        error = InternalError("internal error while streaming")
        if prep.on_error is not None:
            prep.on_error(error)
        yield event(error_body(error))
        prep.sent_done = True
    finally:
        gen.cancel()
        gen.observe_end()
        done()
