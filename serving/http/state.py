"""`ServerState`: what one app instance shares between its handlers (runtime, metrics, drain)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.http.access import Access
from serving.http.context import current
from serving.http.errors import NotFoundError, UnavailableError
from serving.http.metrics import Metrics
from serving.http.model_catalog import parse_keep_alive
from serving.http.model_pool import ModelPool, ServedModel
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings
from serving.http.stats import ErrorLog
from serving.http.usage import UsageBook
from serving.http.usage_log import UsageLog

log = logging.getLogger(__name__)


class ServerState:
    """The app's runtime, metrics, error log, in-flight count and draining flag.

    `active` counts generation requests accepted and not yet answered; `drain()` waits for it
    to reach zero (graceful shutdown), then cancels what is left. `access`: the keys, limits
    and end-of-request hooks (serving/http/access.py). `dumper`: the request dumps
    (`--dump-requests`; None: off). `usage`: the per-tenant usage (serving/http/usage.py).

    owns_runtime: the app starts and stops its runtime: one made here or handed over not yet
    started (`serve`). A runtime handed over already started (another app's: tests, a
    notebook) is borrowed: stopping this app leaves it running.
    """

    def __init__(self, settings: ServerSettings, runtime: ModelRuntime | None = None):
        self.settings = settings
        self.pool = ModelPool(settings, runtime)
        self.owns_runtime = not self.pool.primary.borrowed
        self.access = Access(settings)
        self.metrics = Metrics(lambda: self.runtime, self.pool.rows)
        self.usage = UsageBook(self.metrics.registry, retention=settings.usage_retention,
                               usage_log=(UsageLog(settings.usage_log) if settings.usage_log
                                          else None))
        self.dumper = None
        if settings.dump_requests:
            from serving.http.dumps import RequestDumper
            self.dumper = RequestDumper(settings.dump_requests,
                                        max_file_bytes=settings.dump_file_bytes,
                                        redact=settings.dump_redact)
        self.errors = ErrorLog()
        self.draining = False
        self.active = 0
        self._idle: asyncio.Event | None = None

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.active == 0:
                self._idle.set()
        return self._idle

    def begin(self) -> None:
        """A generation request was accepted."""
        self.active += 1
        self.metrics.requests_active.set(self.active)
        self._idle_event().clear()

    def end(self) -> None:
        """A generation request was answered (or its client left)."""
        self.active -= 1
        self.metrics.requests_active.set(self.active)
        if self.active == 0:
            self._idle_event().set()

    @property
    def runtime(self) -> ModelRuntime:
        """The primary model's runtime (the only one of a one-model server)."""
        return self.pool.primary.runtime

    def require_ready(self) -> ModelRuntime:
        """The primary model's runtime, or 503 while loading, warming up, draining or failed
        (the routes that serve no model of a request's choosing: the LoRA admin routes)."""
        self.refuse_draining()
        rt = self.runtime
        if rt.state == "failed":
            raise UnavailableError(f"the model failed to load: {rt.error}", code="load_failed",
                                   retry_after=30)
        if not rt.ready:
            raise UnavailableError(f"the model is not ready yet ({rt.state})",
                                   code="not_ready", retry_after=5)
        return rt

    def refuse_draining(self) -> None:
        if self.draining or self.runtime.state in ("draining", "stopped"):
            raise UnavailableError("the server is shutting down", code="draining",
                                   retry_after=5)

    async def use_model(self, model: str | None, lora: list[Any] | None = None,
                        keep_alive: Any = None, generate: bool = False
                        ) -> tuple[ModelRuntime, str | dict[str, float] | None]:
        """The runtime of the model a request names (`lookup_model`), loaded or woken when
        needed (serving/http/model_pool.py) and held until the request ends (its context's
        end releases it, with the request's `keep_alive`); and the request's
        `SamplingParams.lora` (`lookup_model`'s). `generate`: the model must generate text
        (a pooling model is a 400). Raises 404 / 400 / 503."""
        self.refuse_draining()
        served, adapters = self.lookup_model(model, lora)
        keep = None if keep_alive is None else parse_keep_alive(keep_alive)
        rt = await self.pool.acquire(served)
        ctx = current()
        if ctx is not None:
            ctx.end_callbacks.append(lambda: self.pool.release(served, keep))
        else:  # outside a request (tests): released at once
            self.pool.release(served, keep)
        if generate and rt.pooler is not None:
            what = ("embeddings (/v1/embeddings, /v1/rerank, /v1/score)"
                    if rt.pooler.info.task == "embed" else "pair scores (/v1/rerank, /v1/score)")
            raise InvalidParameterError(
                f"the model {served.name!r} is an embedding or reranking model: it serves "
                f"{what} and generates no text", param="model")
        if adapters is not None:
            from serving.http.protocol import lora_weights
            ids = ({i: n for i, n in rt.lora_ids().items() if self.access.visible_adapter(n)}
                   if served.primary and rt.scheduler is not None else {})
            return rt, lora_weights(adapters, ids)
        return rt, model if model in self.pool.primary.runtime.lora_paths else None

    def lookup_model(self, model: str | None, lora: list[Any] | None = None
                     ) -> tuple[ServedModel, list[Any] | None]:
        """The served model a request's `model` names: a servable model, a LoRA adapter of
        the primary model (served on it), or omitted (the primary); 404 `model_not_found`
        unless the caller's key may use it (a model it may not use is answered as one that
        does not exist). Returns it and the request's llama.cpp `lora` list, checked
        (400 when the request names an adapter both ways)."""
        served = self.pool.lookup(model)
        adapters = self.pool.primary.runtime.lora_paths
        visible = self.access.visible_model
        target = self.pool.primary.name if model is None else model
        is_adapter = served is not None and target in adapters and target not in \
            self.pool.models
        if served is None or not visible(target, is_adapter=is_adapter):
            shown = [n for n in self.pool.names() if visible(n, is_adapter=False)]
            shown += [n for n in sorted(adapters) if visible(n, is_adapter=True)]
            serves = (f"this server serves {', '.join(map(repr, shown))}" if shown
                      else "your API key may use none of this server's models")
            raise NotFoundError(f"the model {target!r} does not exist; {serves}",
                                code="model_not_found", param="model")
        if lora is not None and is_adapter:
            raise InvalidParameterError(
                f"the request names the LoRA adapter {model!r} as its model and also lists "
                "adapters in lora: give one or the other", param="lora")
        return served, lora

    async def drain(self, grace: float | None = None) -> None:
        """Stops accepting, lets in-flight requests finish within `grace` s, cancels the rest.

        Cancelled requests still get an answer (503 body, or an error event then [DONE]).
        """
        grace = self.settings.grace_period if grace is None else grace
        self.draining = True
        idle = self._idle_event()
        log.info("draining: %d request(s) in flight, grace %.0f s", self.active, grace)
        try:
            await asyncio.wait_for(idle.wait(), grace)
        except TimeoutError:
            log.warning("grace period over: cancelling %d request(s)", self.active)
        await asyncio.to_thread(self.pool.stop)
        try:
            await asyncio.wait_for(idle.wait(), 10.0)
        except TimeoutError:
            log.error("%d request(s) still unanswered after shutdown", self.active)
