"""A submitted request and the stream of events it yields to its caller.

`RequestHandle` is both a blocking iterator (Python API, CLI) and an async iterator (server)
over the same events. The batching loop thread posts events with `post`; when the handle was
created inside an asyncio loop, events reach it through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from metrale_jax.scheduler.events import TERMINAL, Event
from metrale_jax.scheduler.sampling_params import SamplingParams

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What the scheduler needs to run one generation.

    prompt_ids: the prompt's token ids. deadline: `time.monotonic()` value after which the
    request ends with `TimedOut` (None = no deadline). tenant and cache_salt: the prefix
    cache's isolation key (who is calling, and a secret the caller may add): requests share
    cached pages only when both are equal (None and None: the public namespace). The tenant
    is also the waiting queue's unit of fairness (scheduler/waiting.py: round-robin across
    tenants, FIFO within one). tenant_slots: the most slots (rows) the tenant's requests may
    hold at once while others wait (None: no cap), read from the request at the head of the
    tenant's queue. priority: vLLM's, lower value first (default 0): orders the waiting queue
    within the tenants' fairness, and a waiting request may preempt a running one of a worse
    (higher) value (scheduler/waiting.py, scheduler/scheduler.py).
    source: for an encoder-decoder (translation) model, the encoder's input ids (the text to
    translate); `prompt_ids` are then the decoder's prompt (`[</s>, target language]` for
    NLLB). Empty for a decoder-only model.
    images: for a vision-language model, the prompt's images (`vision.prompt.PromptImage`:
    each one's placeholder run offset, pixels and content digest), in prompt order; the
    prompt holds `tokens_per_image` placeholder tokens for each. Empty otherwise.
    pooling: a pooling request (embeddings, rerank scores; needs an engine with
    `pooled_output`): its prompt is prefilled like any other and, when its last piece ends,
    the request ends with a `Pooled` event carrying the last token's final-normed hidden
    state; no token is sampled or streamed, and its row and pages are freed at once.
    max_itl_ms: the longest step this request wants while it decodes (its inter-token
    latency target, ms; clamped by the scheduler to [`step_time.FLOOR_MS`, the server's
    target]); None: the server's.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    deadline: float | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    source: tuple[int, ...] = ()
    images: tuple[Any, ...] = ()
    tenant_slots: int | None = None
    pooling: bool = False
    priority: int = 0
    max_itl_ms: float | None = None

    @classmethod
    def make(cls, prompt_ids: Sequence[int], params: SamplingParams,
             timeout: float | None = None, request_id: str | None = None,
             tenant: str | None = None, cache_salt: str | None = None,
             source: Sequence[int] = (), images: Sequence[Any] = (),
             tenant_slots: int | None = None, pooling: bool = False,
             priority: int = 0,
             max_itl_ms: float | None = None) -> GenerationRequest:
        """Builds a request; `timeout` seconds from now becomes the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        kw = {"request_id": request_id} if request_id else {}
        return cls(tuple(int(t) for t in prompt_ids), params, deadline=deadline,
                   tenant=tenant, cache_salt=cache_salt,
                   source=tuple(int(t) for t in source), images=tuple(images),
                   tenant_slots=tenant_slots, pooling=pooling, priority=priority,
                   max_itl_ms=max_itl_ms, **kw)


class RequestHandle:
    """The caller's end of a request: iterate its events, or `cancel()` it from any thread."""

    def __init__(self, request: GenerationRequest, on_cancel,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self._on_cancel = on_cancel
        self._loop = loop
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self._done = threading.Event()
        # `time.monotonic()` when the request first got a slot (None: still waiting), set by
        # the batching loop; what it waited in the queue is this less its submission.
        self.admitted_at: float | None = None
        # The prompt tokens read from the prefix cache (None until its first admission), set
        # by the batching loop: for an end the caller makes itself (a stop it decides).
        self.cached_tokens: int | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def done(self) -> bool:
        """True once the terminal event has been posted."""
        return self._done.is_set()

    def post(self, event: Event) -> None:
        """Called by the batching loop thread: delivers one event (ignored after the end)."""
        if self._done.is_set():
            return
        if isinstance(event, TERMINAL):
            self._done.set()
        if self._loop is not None:
            # RuntimeError: the caller's event loop is closed, so nobody is listening.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
        else:
            self._sync.put(event)

    def cancel(self) -> None:
        """Asks the scheduler to stop this request; its slot is freed at the next iteration."""
        if not self._done.is_set():
            self._on_cancel(self.request_id)

    def __iter__(self) -> Iterator[Event]:
        if self._loop is not None:
            raise RuntimeError("this handle was created in an event loop: use `async for`")
        while True:
            event = self._sync.get()
            yield event
            if isinstance(event, TERMINAL):
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._async is None:
            raise RuntimeError("this handle was created outside an event loop: use `for`")
        while True:
            event = await self._async.get()
            yield event
            if isinstance(event, TERMINAL):
                return
