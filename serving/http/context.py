"""`RequestContext`: who is calling and what the request used, carried through one request.

Made for every request in the app's first `before_request` hook and kept on `quart.g.ctx`
(`current()` reads it); the access hooks (serving/http/access.py) fill in the key, its
tenant and limits; a generation adds its `Generation` once submitted, and its token
reservation. When the request has ended (the JSON answer is built, or a stream's last event
is sent, or its client left), `Access.finish` reports its actual usage exactly once: it
settles the token reservation and runs the end hooks (`Access.end_hooks`), each of which
gets the finished context (the place for request dumps and per-tenant usage counters).
"""

from __future__ import annotations

import dataclasses
import time
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
    finished: `Access.finish` has run.
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
    finished: bool = False

    @property
    def tenant(self) -> str | None:
        """The caller's tenant (None: no key)."""
        return self.key.tenant if self.key is not None else None

    @property
    def key_name(self) -> str | None:
        """The caller's key's name (never the key; None: no key)."""
        return self.key.name if self.key is not None else None


def current() -> RequestContext | None:
    """The context of the request being handled (None outside a request)."""
    if not has_request_context():
        return None
    return getattr(g, "ctx", None)
