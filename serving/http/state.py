"""`ServerState`: what one app instance shares between its handlers (runtime, metrics, drain)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.http.access import Access
from serving.http.errors import NotFoundError, UnavailableError
from serving.http.metrics import Metrics
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings
from serving.http.stats import ErrorLog
from serving.http.usage import UsageBook

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
        self.runtime = runtime or ModelRuntime(settings)
        self.owns_runtime = self.runtime.state == "starting"
        self.access = Access(settings)
        self.metrics = Metrics(lambda: self.runtime)
        self.usage = UsageBook(self.metrics.registry, retention=settings.usage_retention)
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

    def require_ready(self) -> ModelRuntime:
        """The runtime, or 503 while loading, warming up, draining or failed."""
        rt = self.runtime
        if self.draining or rt.state in ("draining", "stopped"):
            raise UnavailableError("the server is shutting down", code="draining",
                                   retry_after=5)
        if rt.state == "failed":
            raise UnavailableError(f"the model failed to load: {rt.error}", code="load_failed",
                                   retry_after=30)
        if not rt.ready:
            raise UnavailableError(f"the model is not ready yet ({rt.state})",
                                   code="not_ready", retry_after=5)
        return rt

    def require_generator(self) -> ModelRuntime:
        """The runtime of a model that generates text (`require_ready`), or a 400 naming
        what a pooling (embedding or reranking) model serves instead."""
        rt = self.require_ready()
        if rt.pooler is not None:
            from metrale_jax.errors import InvalidParameterError
            what = ("embeddings (/v1/embeddings, /v1/rerank, /v1/score)"
                    if rt.pooler.info.task == "embed" else "pair scores (/v1/rerank, /v1/score)")
            raise InvalidParameterError(
                f"the model {self.settings.model_name!r} is an embedding or reranking model: "
                f"it serves {what} and generates no text", param="model")
        return rt

    def check_model(self, model: str | None, lora: list[Any] | None = None
                    ) -> str | dict[str, float] | None:
        """404 `model_not_found` unless `model` is the served model's name, one of its LoRA
        adapters' names, or omitted (the served model), and the caller's key may use it (a
        model it may not use is answered as one that does not exist). Returns the
        request's `SamplingParams.lora`: its llama.cpp `lora` list ({name: scale}; ids of
        adapters the key may not use are unknown ids), else the adapter `model` names, else
        None (the active adapters)."""
        name = self.settings.model_name
        served = self.runtime.lora_paths
        visible = self.access.visible_model
        target = name if model is None else model
        if not ((target == name or target in served)
                and visible(target, is_adapter=target != name)):
            shown = [n for n in sorted(served) if visible(n, is_adapter=True)]
            adapters = f" and the LoRA adapters {shown}" if shown else ""
            if visible(name, is_adapter=False):
                serves = f"this server serves {name!r}{adapters}"
            elif shown:
                serves = f"this server serves the LoRA adapters {shown}"
            else:
                serves = "your API key may use none of this server's models"
            raise NotFoundError(f"the model {target!r} does not exist; {serves}",
                                code="model_not_found", param="model")
        if lora is not None:
            if model in served:
                raise InvalidParameterError(
                    f"the request names the LoRA adapter {model!r} as its model and also "
                    "lists adapters in lora: give one or the other", param="lora")
            from serving.http.protocol import lora_weights
            ids = {i: n for i, n in self.runtime.lora_ids().items()
                   if self.access.visible_adapter(n)}
            return lora_weights(lora, ids)
        return model if model in served else None

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
        if self.owns_runtime:
            await asyncio.to_thread(self.runtime.stop)
        try:
            await asyncio.wait_for(idle.wait(), 10.0)
        except TimeoutError:
            log.error("%d request(s) still unanswered after shutdown", self.active)
