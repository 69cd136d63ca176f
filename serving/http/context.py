"""`RequestContext`: who is calling and what the request used, carried through one request.

Made for every request in the app's first `before_request` hook and kept on `quart.g.ctx`
(`current()` reads it); the access hooks (serving/http/access.py) fill in the key, its
tenant and limits; a generation adds its `Generation` once submitted, and its token
reservation; the app's hooks add the status and error answered. Once a generation's usage is
known (its JSON answer built, or its stream ended, or its client gone), `Access.settle`
charges it to the key's limits (before the answer's `x-ratelimit-*` headers are written);
once the request has ended (after its answer was sent, or a stream's last event, or its
client left), `Access.finish` runs the end hooks (`Access.end_hooks`) exactly once, each of
which gets the finished context: the request dump, the log line and the per-tenant usage
(serving/http/request_end.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from quart import g, has_request_context

from serving.http.keys import ApiKey
from serving.http.limits import KeyLimiter, Reservation


@dataclasses.dataclass
class RequestContext:
    """One request's context.

    seq: the request's sequence number for request dumps (not numbered yet: None).
    request_id: the `x-request-id` of the answer. method, path: the route asked for.
    started: `time.time()` at arrival; started_mono: `time.monotonic()` at arrival.
    key: the caller's key entry (never the key itself; None: the server has no keys, or the
        route is open). limiter: that key's live limits (None: no keys).
    reservation: the tokens a generation reserved at admission (None: none yet).
    generation: the `serving.http.generation.Generation` once submitted (None: no
        generation, or it never reached the scheduler).
    usage: the OpenAI usage object once the request ended ({} when it used no tokens).
    deferred: the answer outlives its handler (a stream): its end finishes the context.
    settled: the usage is known and charged to the key's limits (`Access.settle`).
    finished: `Access.finish` has run.
    status: the HTTP status answered (None: no answer was sent: the client left first).
    error: the OpenAI error answered, `{"type", "code", "message"}` (a stream's error event
        too; None: none).
    body: the request's JSON body as parsed (None: none, or not JSON).
    stream: the answer is a stream; stream_done: its last event (`[DONE]`) was sent.
    outcome: called once the request ended, the (finish reasons, texts) of its choices as
        the client saw them (set by the generation routes; None: no choices).
    end_callbacks: called once the request ended, before the end hooks (the model pool's
        release of the model the request used).
    """

    request_id: str
    method: str
    path: str
    started: float = dataclasses.field(default_factory=time.time)
    started_mono: float = dataclasses.field(default_factory=time.monotonic)
    seq: int | None = None
    key: ApiKey | None = None
    limiter: KeyLimiter | None = None
    counted: bool = False  # the key's concurrency counts this request
    reservation: Reservation | None = None
    generation: Any = None
    usage: dict[str, Any] | None = None
    deferred: bool = False
    settled: bool = False
    finished: bool = False
    status: int | None = None
    error: dict[str, Any] | None = None
    body: Any = None
    stream: bool = False
    stream_done: bool = False
    outcome: Callable[[], tuple[list[str | None], list[str | None]]] | None = None
    end_callbacks: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @property
    def tenant(self) -> str | None:
        """The caller's tenant (None: no key)."""
        return self.key.tenant if self.key is not None else None

    @property
    def cancelled(self) -> bool:
        """The client left before the whole answer was sent (no answer at all, or a stream
        ended without its last event and without an error)."""
        if self.status is None:
            return True
        return self.stream and not self.stream_done and self.error is None

    @property
    def timed_out(self) -> bool:
        """The request's deadline passed (answered 408, or a stream's timeout event)."""
        return self.error is not None and self.error.get("code") == "timeout"

    def label(self) -> str:
        """How log lines name the request: `#<seq> (<request id>)`, or the request id when
        requests are not numbered."""
        return f"#{self.seq} ({self.request_id})" if self.seq is not None else self.request_id

    @property
    def key_name(self) -> str | None:
        """The caller's key's name (never the key; None: no key)."""
        return self.key.name if self.key is not None else None


def current() -> RequestContext | None:
    """The context of the request being handled (None outside a request)."""
    if not has_request_context():
        return None
    return getattr(g, "ctx", None)
