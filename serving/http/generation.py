"""`Generation`: the scheduler requests behind one HTTP request (n choices per prompt).

It submits every choice, merges their event streams into one `(choice index, event)` stream,
updates the metrics, and maps terminal events that are not a normal finish to the server's
errors. `cancel()` (client gone, error in a sibling choice) frees every slot at the scheduler's
next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.scheduler import (
    Cancelled,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    TimedOut,
    Token,
    TokenLogprob,
)
from serving.http.errors import InternalError, RequestTimeoutError, UnavailableError
from serving.http.metrics import Metrics
from serving.http.responses import usage

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_index: int
    prompt_tokens: int
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_token_at: float | None = None

    @property
    def output(self) -> str:
        """The generated text."""
        return "".join(self.text)


class Generation:
    """The engine requests of one HTTP request.

    Args:
        runtime: the `ModelRuntime` (its scheduler must be ready).
        metrics: the app's `Metrics`.
        prompts: token ids of each prompt; each gets `n` choices, indexed prompt-major.
        params: the `SamplingParams` of one choice; choice i of a prompt gets `seed + i`.
            With num_beams > 1 a prompt is one beam search whose n best hypotheses are its
            n choices.
        timeout: seconds until the request ends with a timeout (None = none).
        request_id: the HTTP request id; engine requests get `<id>-<index>`.
        tenant, cache_salt: the prefix cache's isolation key (`GenerationRequest`); the
            tenant is also the scheduler's unit of fairness.
        tenant_slots: the most slots the tenant's requests may hold at once (None: no cap).
        priority: every engine request's `priority` (lower first; scheduler/waiting.py).
        sources: a translation model's encoder inputs, one per prompt (the prompts are then
            the decoder's); their tokens count as prompt tokens. None: a decoder-only model.
        images: a vision-language model's `PromptImage`s, one tuple per prompt (their
            placeholder runs are in the prompt's ids, and counted). None: no images.
        max_itl_ms: the request's latency target (`GenerationRequest.max_itl_ms`; None: the
            server's).
    """

    def __init__(self, runtime: Any, metrics: Metrics, prompts: Sequence[Sequence[int]],
                 params: SamplingParams, n: int, timeout: float | None, request_id: str,
                 tenant: str | None = None, cache_salt: str | None = None,
                 sources: Sequence[Sequence[int]] | None = None,
                 images: Sequence[Sequence[Any]] | None = None,
                 tenant_slots: int | None = None, priority: int = 0,
                 max_itl_ms: float | None = None):
        self.runtime = runtime
        self.metrics = metrics
        self.timeout = timeout
        self.arrived = time.monotonic()
        self.prompts = [list(ids) for ids in prompts]
        self.requests: list[GenerationRequest] = []
        self.choices: list[ChoiceState] = []
        self.beam_choices: dict[int, list[int]] = {}  # a beam request -> its choices
        for p, ids in enumerate(prompts):
            source = tuple(sources[p]) if sources is not None else ()
            pictures = tuple(images[p]) if images is not None else ()
            counted = len(ids) + len(source)
            if params.num_beams > 1:
                sp = dataclasses.replace(params, num_return_sequences=n)
                self.beam_choices[len(self.requests)] = list(range(len(self.choices),
                                                                   len(self.choices) + n))
                self.requests.append(GenerationRequest.make(
                    ids, sp, timeout=timeout, request_id=f"{request_id}-{len(self.requests)}",
                    tenant=tenant, cache_salt=cache_salt, source=source,
                    images=pictures, tenant_slots=tenant_slots, priority=priority,
                    max_itl_ms=max_itl_ms))
                self.choices += [ChoiceState(len(self.choices) + i, p, counted)
                                 for i in range(n)]
                continue
            for i in range(n):
                sp = params
                if params.seed is not None and i:
                    sp = dataclasses.replace(params, seed=params.seed + i)
                index = len(self.requests)
                self.requests.append(GenerationRequest.make(
                    ids, sp, timeout=timeout, request_id=f"{request_id}-{index}",
                    tenant=tenant, cache_salt=cache_salt, source=source,
                    images=pictures, tenant_slots=tenant_slots, priority=priority,
                    max_itl_ms=max_itl_ms))
                self.choices.append(ChoiceState(index, p, counted))
        self.handles: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self.first_token_at: float | None = None  # time.monotonic() of the first token
        self._watchers: dict[int, Callable[[str], bool]] = {}  # choice -> its early stop
        self._stopped: set[int] = set()  # choices ended here (their later events dropped)

    def stop_when(self, make: Callable[[], Callable[[str], bool]] | None) -> None:
        """Gives every sampled choice (not a beam search's) a watcher `make()`, fed each of
        its `Token`s' text: when it answers True the choice ends at once, with a `Finished`
        (finish reason "stop", the tokens received so far) made here, and its engine request
        is cancelled so nothing more is generated (a forced tool choice's answer is
        complete: `ChatOutput.early_stop`). None: no watchers."""
        if make is None:
            return
        for i in range(len(self.requests)):
            if i not in self.beam_choices:
                self._watchers[i] = make()

    @property
    def queue_seconds(self) -> float | None:
        """Seconds from submission until the first choice got a slot (None: none did)."""
        admitted = [h.admitted_at for h in self.handles if h.admitted_at is not None]
        return max(0.0, min(admitted) - self.arrived) if admitted else None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (as OpenAI counts them)."""
        seen: dict[int, int] = {c.prompt_index: c.prompt_tokens for c in self.choices}
        return sum(seen.values())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt as the prompt
        tokens are (its first choice's: the others share what that one prefilled)."""
        first: dict[int, int] = {}
        for c in self.choices:
            first.setdefault(c.prompt_index, c.cached_tokens)
        return sum(first.values())

    def usage(self) -> dict[str, Any]:
        """The OpenAI `usage` object of the request so far."""
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @property
    def token_budget(self) -> int:
        """The most tokens the request may use (what a tokens-per-minute limit reserves): its
        prompt tokens plus, for every choice, `max_tokens` or what the context leaves."""
        max_len = self.runtime.scheduler.max_len
        total = self.prompt_tokens
        for r in self.requests:
            p = r.params
            room = max(0, max_len - len(r.prompt_ids))
            most = min(p.max_tokens, room) if p.max_tokens is not None else room
            total += most * (p.num_return_sequences if p.num_beams > 1 else 1)
        return total

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over every choice."""
        return sum(c.completion_tokens for c in self.choices)

    def check(self, prompt_param: str = "messages") -> None:
        """Validates every request against the engine (context length, token ids).

        prompt_param: the request field a prompt error points at ("messages" or "prompt").
        """
        for r in self.requests:
            try:
                self.runtime.scheduler.check(r)
            except MetraleError as e:
                if e.param in ("messages", "prompt", "images"):
                    e.param = prompt_param
                raise

    def submit(self) -> None:
        """Queues every choice; on a failure (queue full) cancels those already queued."""
        loop = asyncio.get_running_loop()
        try:
            for r in self.requests:
                self.handles.append(self.runtime.scheduler.submit(r, loop=loop))
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancels every unfinished choice (safe to call more than once)."""
        for h in self.handles:
            h.cancel()
        for t in self._tasks:
            t.cancel()

    async def events(self) -> AsyncIterator[tuple[ChoiceState, Event]]:
        """Every choice's events, merged in arrival order; raises on an error event.

        `Token` events update the choice before they are yielded; a `Finished` event sets its
        finish reason. A timeout, shutdown or failure raises the server error it maps to.
        """
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def pump(i: int, handle: Any) -> None:
            try:
                async for event in handle:
                    if i in self.beam_choices:
                        self._beam_events(self.beam_choices[i], event, queue)
                    else:
                        queue.put_nowait((i, event))
            finally:
                queue.put_nowait((i, None))

        self._tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        open_ = len(self._tasks)
        try:
            while open_:
                i, event = await queue.get()
                if event is None:
                    open_ -= 1
                    continue
                if i in self._stopped:
                    continue
                choice = self.choices[i]
                self._account(choice, event)
                error = self._error(event)
                if error is not None:
                    raise error
                yield choice, event
                watcher = self._watchers.get(i)
                if isinstance(event, Token) and watcher is not None and watcher(event.text):
                    yield choice, self._stop(i)
        finally:
            self.cancel()
            for t in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def _stop(self, i: int) -> Finished:
        """Ends choice `i` here (see `stop_when`): cancels its engine request; its end."""
        self._stopped.add(i)
        handle = self.handles[i]
        handle.cancel()
        choice = self.choices[i]
        end = Finished("stop", choice.prompt_tokens, choice.completion_tokens,
                       cached_tokens=getattr(handle, "cached_tokens", None) or 0)
        self._account(choice, end)
        return end

    @staticmethod
    def _beam_events(choices: list[int], event: Event, queue: asyncio.Queue) -> None:
        """A beam search's events as its choices' events: its n hypotheses (in `Finished`)
        become n choices' tokens and ends; its other ends go to its first choice."""
        if isinstance(event, Token):
            return  # the best hypothesis's ids: in `Finished.beams` as well
        if not isinstance(event, Finished):
            queue.put_nowait((choices[0], event))
            return
        for index, hyp in zip(choices, event.beams, strict=False):
            queue.put_nowait((index, Token(hyp.token_ids, hyp.text)))
            stop = event.stop_reason if index == choices[0] else None
            queue.put_nowait((index, Finished(hyp.finish_reason, event.prompt_tokens,
                                              len(hyp.token_ids), stop, "",
                                              event.cached_tokens)))

    def _account(self, choice: ChoiceState, event: Event) -> None:
        m = self.metrics
        now = time.monotonic()
        if isinstance(event, Token):
            n = len(event.token_ids)
            if self.first_token_at is None:
                self.first_token_at = now
            if choice.last_token_at is None:
                m.ttft.observe(now - self.arrived)
            else:
                m.tpot.observe((now - choice.last_token_at) / max(n, 1))
            choice.last_token_at = now
            choice.token_ids.extend(event.token_ids)
            choice.completion_tokens += n
            choice.text.append(event.text)
            choice.logprobs.extend(event.logprobs)
        elif isinstance(event, Finished):
            choice.text.append(event.text)
            choice.finish_reason = event.finish_reason
            choice.stop_reason = event.stop_reason
            choice.completion_tokens = event.completion_tokens
            choice.cached_tokens = event.cached_tokens
            m.request_success.labels(finished_reason=event.finish_reason).inc()
        if isinstance(event, (Finished, Cancelled, TimedOut)):
            m.prompt_tokens.inc(event.prompt_tokens)
            m.generation_tokens.inc(event.completion_tokens)

    def _error(self, event: Event) -> MetraleError | None:
        if isinstance(event, TimedOut):
            return RequestTimeoutError(f"the request timed out after {self.timeout:g} s")
        if isinstance(event, Cancelled):
            if event.reason == "shutdown":
                return UnavailableError("the server is shutting down; retry",
                                        code="shutting_down")
            return UnavailableError("the request was cancelled", code="cancelled")
        if isinstance(event, Failed):
            if event.is_user_error:
                return event.error
            log.error("generation %s failed", self.requests[0].request_id,
                      exc_info=event.error)
            return InternalError(f"generation failed: {type(event.error).__name__}")
        return None

    def observe_end(self) -> None:
        """Records the request's end-to-end latency."""
        self.metrics.e2e.observe(time.monotonic() - self.arrived)
