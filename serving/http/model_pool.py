"""`ModelPool`: several models in one server, loaded on demand within a memory budget.

Every servable model (serving/http/model_catalog.py) is a `ServedModel` with a `ModelRuntime`
(a fresh, unstarted one while it is on disk). A request names its model; `acquire` loads it
when it is not loaded (concurrent first requests share one load), counts the request in flight
until `release`, and keeps it from being unloaded meanwhile. Loading asks for room first:
the number of loaded models (`max_loaded_models`) and the bytes per device of their memory
plans (`ModelRuntime.footprint`: params, KV pool, scratch) within the budget
(`memory_budget_gb`, else the device's memory less the plan's reserve where it reports one).
The least recently used idle model is unloaded to make room; when every loaded model is busy
the load waits (`model_wait_timeout`), then the request gets a 503 with Retry-After.

An idle model unloads on its own after its keep-alive (Ollama's: a request's `keep_alive`
sets its model's; 0 unloads once answered, a negative one never). Admin routes load, unload,
sleep and wake models (`routes/models.py`). Sleep level 1 keeps the params on the host and
the compiled programs (`ModelRuntime.sleep`), level 2 drops everything but the name (waking
loads again). Each operation on a model runs one at a time (`ServedModel.task`); requests on
other models go on meanwhile. Loading runs in the runtime's thread; the event loop never
blocks. A model reloaded finds its compiled programs in the executable store or JAX's
persistent cache (`ModelRuntime.programs`: (compiled, compiled afresh)).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import math
import time
from typing import Any

from metrale_jax.engine.memory_plan import device_memory_bytes
from metrale_jax.errors import InvalidParameterError
from metrale_jax.host_memory import release_free_memory
from serving.http.errors import UnavailableError
from serving.http.model_catalog import DEFAULT_POOL_KEEP_ALIVE, CatalogEntry, catalog
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings

log = logging.getLogger(__name__)

GiB = 1024**3
STATES = ("on_disk", "loading", "loaded", "unloading", "sleeping", "waking", "failed")
RESERVE_FRACTION = 0.1  # of a device's memory, left to XLA beside the models (memory_plan)


@dataclasses.dataclass(eq=False)
class ServedModel:
    """One servable model and its place in the pool.

    runtime: its `ModelRuntime` (unstarted while on disk); in_flight: requests holding it;
    last_used: `time.monotonic()` of its last acquire or release; keep_alive: seconds it
    stays loaded once idle (`math.inf`: until room is needed); task: the load, unload, sleep
    or wake under way (None: none); op: which; sleep_level: 0 awake, 1 or 2 asleep;
    requests: requests served; loads: loads done; load_seconds: the last load's (or wake's)
    wall time; borrowed: the runtime belongs to someone else (never stopped here).
    """

    name: str
    settings: ServerSettings
    primary: bool
    runtime: ModelRuntime
    keep_alive: float
    borrowed: bool = False
    in_flight: int = 0
    last_used: float = 0.0
    task: asyncio.Task | None = None
    op: str | None = None
    sleep_level: int = 0
    requests: int = 0
    loads: int = 0
    load_seconds: float | None = None
    footprint: int = 0
    expiry: asyncio.TimerHandle | None = None

    @property
    def state(self) -> str:
        """One of `STATES`."""
        if self.op is not None:
            return self.op
        if self.sleep_level:
            return "sleeping"
        rt = self.runtime.state
        if rt == "ready":
            return "loaded"
        if rt in ("loading", "warming_up"):
            return "loading"
        if rt == "failed":
            return "failed"
        return "on_disk"

    @property
    def resident(self) -> bool:
        """Holds (or is taking) device memory: loading, loaded, or being unloaded or put to
        sleep."""
        return self.state in ("loading", "loaded", "unloading", "waking") or (
            self.op == "sleeping")

    @property
    def evictable(self) -> bool:
        """Loaded, idle, and nothing under way: may be unloaded to make room."""
        return (self.state == "loaded" and self.in_flight == 0 and self.task is None
                and not self.borrowed)

    def describe(self) -> dict[str, Any]:
        """The model's row in the admin list, the stats and `metrale top`."""
        from serving.http.model_catalog import format_keep_alive
        compiled, fresh = self.runtime.programs
        idle = (time.monotonic() - self.last_used
                if self.in_flight == 0 and self.last_used else None)
        return {"id": self.name, "root": str(self.settings.model), "state": self.state,
                "primary": self.primary, "in_flight": self.in_flight,
                "requests": self.requests, "loads": self.loads,
                "load_seconds": self.load_seconds, "memory_bytes": self.footprint
                if self.resident else 0, "host_bytes": self.runtime.host_bytes,
                "sleep_level": self.sleep_level,
                "keep_alive": format_keep_alive(self.keep_alive), "idle_seconds": idle,
                "programs": {"compiled": compiled, "compiled_afresh": fresh,
                             "compiling": self.runtime.compiling},
                "error": str(self.runtime.error) if self.runtime.error else None}


class ModelPool:
    """The servable models of `settings` (the primary one's runtime may be given: borrowed
    when already started, as `ServerState` says)."""

    def __init__(self, settings: ServerSettings, runtime: ModelRuntime | None = None):
        self.settings = settings
        entries = catalog(settings)
        self.several = len(entries) > 1
        default_keep = settings.keep_alive
        if default_keep is None:
            default_keep = DEFAULT_POOL_KEEP_ALIVE if self.several else math.inf
        self.default_keep_alive = default_keep
        # Multi-host: every process must run every program in one order, so one model is
        # loaded at a time; process 0 tells the others which (`_load`, `_unload`) over the
        # side channel, which the pool takes over from the first model's runtime.
        self.multihost = self.several and settings.num_processes > 1
        self.channel: Any = None
        self.models: dict[str, ServedModel] = {}
        for entry in entries:
            given = runtime if entry.primary else None
            rt = (given if given is not None and given.state != "starting"
                  else self._runtime(entry, given))
            self.models[entry.name] = ServedModel(
                entry.name, entry.settings, entry.primary, rt, default_keep,
                borrowed=entry.primary and runtime is not None and rt.state != "starting")
        self.primary = next(m for m in self.models.values() if m.primary)
        self._initial = self.primary.runtime
        self.max_loaded = 1 if self.multihost else settings.max_loaded_models
        self.budget = self._budget(settings)
        self._changed: asyncio.Event | None = None
        self._room = asyncio.Lock()

    def _runtime(self, entry: CatalogEntry | ServedModel,
                 runtime: ModelRuntime | None = None) -> ModelRuntime:
        """A fresh runtime of `entry`, or `runtime` (handed over, not started) made one of
        the pool's: in a pool of several models it asks for room before loading and, on
        several hosts, follows the pool's side channel."""
        runtime = runtime or ModelRuntime(entry.settings)
        if not self.several:
            return runtime
        model = entry if isinstance(entry, ServedModel) else None
        runtime.shared_channel = self.channel
        runtime.follower_engine = self.follower_engine
        runtime.admit = lambda need: self._admit_from_thread(model or self.models[entry.name],
                                                             need)
        return runtime

    @staticmethod
    def _budget(settings: ServerSettings) -> int | None:
        """The bytes per device the loaded models may hold together (None: unbounded)."""
        if settings.memory_budget_gb is not None:
            if not 0 < settings.memory_budget_gb < math.inf:
                raise InvalidParameterError("--memory-budget-gb must be a positive number",
                                            param="memory_budget_gb")
            return int(settings.memory_budget_gb * GiB)
        memory = device_memory_bytes(memory_gb=settings.engine_options.get("memory_gb"))
        return None if memory is None else int(memory * (1 - RESERVE_FRACTION))

    @property
    def serving(self) -> bool:
        """The server answers requests (/health 200): the primary model's first load is done
        (later, a model loads on demand)."""
        rt = self.primary.runtime
        return rt is not self._initial or rt.state in ("ready", "sleeping")

    def bind_loop(self) -> None:
        """Remembers the server's event loop (where the loading threads ask for room) and
        counts the primary model's load at start once it is done."""
        self._loop = asyncio.get_running_loop()
        primary, runtime = self.primary, self.primary.runtime

        async def started() -> None:
            await runtime.wait_loaded()
            if runtime.ready and primary.runtime is runtime:
                primary.loads += 1
                primary.footprint = runtime.footprint
                primary.last_used = time.monotonic()
        if not primary.borrowed and runtime.state in ("loading", "warming_up"):
            self._started = self._loop.create_task(started())

    # ---- names -------------------------------------------------------------------------
    def lookup(self, name: str | None) -> ServedModel | None:
        """The model a request's `model` names: a servable model, a LoRA adapter of the
        primary one (its base), or (None) the primary; None when it names nothing served."""
        if name is None:
            return self.primary
        model = self.models.get(name)
        if model is not None:
            return model
        if name in self.primary.runtime.lora_paths:
            return self.primary
        return None

    def names(self) -> list[str]:
        """Every servable model's name, the primary first."""
        return list(self.models)

    # ---- requests ----------------------------------------------------------------------
    async def acquire(self, model: ServedModel) -> ModelRuntime:
        """`model`'s runtime once it is ready (loading or waking it first), counted in
        flight until `release`. Raises `UnavailableError` (503) when it cannot be loaded:
        no room while every loaded model is busy, or its loading failed."""
        while True:
            if model.state == "loaded" and model.task is None:
                break
            if model.task is not None:
                await asyncio.shield(model.task)
                continue
            if model.state == "failed" and not self.several:
                rt = model.runtime
                raise UnavailableError(f"the model failed to load: {rt.error}",
                                       code="load_failed", retry_after=30)
            if model.state == "sleeping":
                self._start(model, "waking", self._wake(model))
            elif model.state in ("on_disk", "failed"):
                self._start(model, "loading", self._load(model))
            else:  # the primary model still loading at start (/health says 503 too)
                raise UnavailableError(f"the model {model.name!r} is not ready yet "
                                       f"({model.runtime.state})", code="not_ready",
                                       retry_after=5)
        self._cancel_expiry(model)
        model.in_flight += 1
        model.requests += 1
        model.last_used = time.monotonic()
        return model.runtime

    def release(self, model: ServedModel, keep_alive: float | None = None) -> None:
        """A request on `model` ended; `keep_alive` (seconds, `math.inf`: forever), when the
        request gave one, becomes the model's. An idle model's keep-alive starts now."""
        model.in_flight -= 1
        model.last_used = time.monotonic()
        if keep_alive is not None:
            model.keep_alive = keep_alive
        if model.in_flight == 0:
            self._schedule_expiry(model)
        self._notify()

    # ---- admin -------------------------------------------------------------------------
    async def load(self, model: ServedModel) -> None:
        """Loads (or wakes) `model` without serving a request on it."""
        await self.acquire(model)
        self.release(model)

    def release_idle(self, model: ServedModel) -> None:
        """Restarts an idle model's keep-alive (its keep_alive changed)."""
        if model.in_flight == 0 and model.state == "loaded":
            self._schedule_expiry(model)

    async def unload(self, model: ServedModel) -> None:
        """Unloads `model` once its requests in flight have finished (a sleeping model: its
        host copy is dropped too)."""
        self._refuse_borrowed(model)
        while model.task is not None:
            await asyncio.shield(model.task)
        if model.state in ("on_disk", "failed") and not model.sleep_level:
            return
        await self._run(model, "unloading", self._unload(model))

    async def sleep(self, model: ServedModel, level: int) -> None:
        """Frees `model`'s device memory once its requests in flight have finished: level 1
        keeps its params on the host (and its compiled programs), level 2 only its name
        (waking is a load). An embedding or reranking model sleeps at level 2."""
        self._refuse_borrowed(model)
        if level not in (1, 2):
            raise InvalidParameterError("level must be 1 (keep the weights on the host) or 2 "
                                        "(drop them)", param="level")
        while model.task is not None:
            await asyncio.shield(model.task)
        if model.sleep_level:
            if level == 2 and model.sleep_level == 1:  # drop the host copy too
                await self._run(model, "unloading", self._unload(model, sleep_level=2))
            return
        if model.state != "loaded":
            raise InvalidParameterError(f"the model {model.name!r} is {model.state}: only a "
                                        "loaded model can sleep", param="model")
        if level == 1 and model.runtime.can_sleep:
            await self._run(model, "sleeping", self._sleep(model))
        else:
            await self._run(model, "unloading", self._unload(model, sleep_level=2))

    async def wake(self, model: ServedModel) -> None:
        """Wakes a sleeping model (a loaded one: nothing to do)."""
        if model.state not in ("sleeping", "waking"):
            if model.state == "loaded":
                return
            raise InvalidParameterError(f"the model {model.name!r} is {model.state}, not "
                                        "sleeping", param="model")
        await self.load(model)

    def _refuse_borrowed(self, model: ServedModel) -> None:
        if model.borrowed or (self.settings.num_processes > 1 and not self.several):
            raise InvalidParameterError(
                f"the model {model.name!r} is held by this process's owner (a notebook's LLM "
                "or a multi-host server) and cannot be unloaded or put to sleep here",
                param="model")

    # ---- the operations ----------------------------------------------------------------
    def _start(self, model: ServedModel, op: str, work: Any) -> asyncio.Task:
        """Runs `work` as `model`'s one operation under way (its state is `op` meanwhile)."""
        model.op = op

        async def run() -> None:
            try:
                await work
            finally:
                model.op = None
                model.task = None
                self._notify()

        model.task = asyncio.get_running_loop().create_task(run())
        model.task.add_done_callback(_retrieve)
        return model.task

    async def _run(self, model: ServedModel, op: str, work: Any) -> None:
        await asyncio.shield(self._start(model, op, work))

    async def _load(self, model: ServedModel) -> None:
        t0 = time.monotonic()
        async with self._room:
            await self._make_room(model, model.footprint)
            if model.runtime.state != "starting" or self.multihost:
                model.runtime = self._runtime(model)
            if self.multihost:  # the other processes load it too, now, in this order
                self.channel.send({"op": "load", "model": model.name})
            model.runtime.start()
        await model.runtime.wait_loaded()
        rt = model.runtime
        if rt.state != "ready":
            error = rt.error
            if isinstance(error, UnavailableError):  # no room: back on disk, untouched
                model.runtime = self._runtime(model)
                raise error
            raise UnavailableError(f"the model {model.name!r} failed to load: {error}",
                                   code="load_failed", retry_after=30)
        model.footprint = rt.footprint
        model.loads += 1
        model.load_seconds = time.monotonic() - t0
        model.last_used = time.monotonic()
        log.info("model %s loaded in %.1f s (%.2f GiB per device)", model.name,
                 model.load_seconds, model.footprint / GiB)

    async def _unload(self, model: ServedModel, sleep_level: int = 0) -> None:
        await self._wait_idle(model)
        old = model.runtime
        if self.multihost and self.channel is None:  # the first model's, from now the pool's
            self.channel = old.release_channel()
        model.runtime = self._runtime(model)
        await asyncio.to_thread(old.stop)
        del old
        if self.multihost:  # its batching loop is stopped: the others let it go too
            self.channel.send({"op": "unload"})
        await asyncio.to_thread(_collect)
        model.sleep_level = sleep_level
        log.info("model %s %s", model.name, "asleep (level 2)" if sleep_level else "unloaded")

    async def _sleep(self, model: ServedModel) -> None:
        await self._wait_idle(model)
        await asyncio.to_thread(model.runtime.sleep)
        model.sleep_level = 1
        await asyncio.to_thread(_collect)
        log.info("model %s asleep (level 1: %.2f GiB on the host)", model.name,
                 model.runtime.host_bytes / GiB)

    async def _wake(self, model: ServedModel) -> None:
        if model.sleep_level == 2:
            model.sleep_level = 0
            await self._load(model)
            return
        t0 = time.monotonic()
        async with self._room:
            await self._make_room(model, model.footprint)
            model.sleep_level = 0
            model.op = "waking"
        await asyncio.to_thread(model.runtime.wake)
        model.load_seconds = time.monotonic() - t0
        model.last_used = time.monotonic()
        log.info("model %s awake in %.2f s", model.name, model.load_seconds)

    async def _wait_idle(self, model: ServedModel) -> None:
        while model.in_flight:
            await self._changed_event().wait()

    # ---- room --------------------------------------------------------------------------
    def _admit_from_thread(self, model: ServedModel, need: int) -> None:
        """The loading thread's question (`ModelRuntime.admit`): room for `need` bytes per
        device, made on the event loop (raises what `_make_room` raises)."""
        model.footprint = need
        loop = self._loop
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._admit(model, need), loop).result()

    async def _admit(self, model: ServedModel, need: int) -> None:
        async with self._room:
            await self._make_room(model, need)

    async def _make_room(self, model: ServedModel, need: int) -> None:
        """Unloads idle models, least recently used first, until `model` (with `need` bytes
        per device) fits the count and the budget; waits while every loaded model is busy,
        up to `model_wait_timeout`, then raises `UnavailableError`."""
        self._loop = asyncio.get_running_loop()
        if self.budget is not None and need > self.budget:
            raise UnavailableError(
                f"the model {model.name!r} needs {need / GiB:.2f} GiB per device; the memory "
                f"budget is {self.budget / GiB:.2f} GiB", code="model_too_large",
                retry_after=60)
        deadline = time.monotonic() + self.settings.model_wait_timeout
        while True:
            others = [m for m in self.models.values() if m is not model and m.resident]
            over_count = self.max_loaded is not None and len(others) + 1 > self.max_loaded
            over_bytes = self.budget is not None and (
                sum(m.footprint for m in others) + need > self.budget)
            if not (over_count or over_bytes):
                return
            idle = sorted((m for m in others if m.evictable), key=lambda m: m.last_used)
            if idle:
                victim = idle[0]
                log.info("unloading %s (idle) to make room for %s", victim.name, model.name)
                await self._run(victim, "unloading", self._unload(victim))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                busy = ", ".join(sorted(m.name for m in others))
                raise UnavailableError(
                    f"no room to load the model {model.name!r}: every loaded model is busy "
                    f"({busy}); retry later", code="no_room_for_model", retry_after=5)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed_event().wait(), left)

    _loop: asyncio.AbstractEventLoop | None = None

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        """Wakes whoever waits for a model to become idle or for room."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # ---- keep-alive --------------------------------------------------------------------
    def _cancel_expiry(self, model: ServedModel) -> None:
        if model.expiry is not None:
            model.expiry.cancel()
            model.expiry = None

    def _schedule_expiry(self, model: ServedModel) -> None:
        self._cancel_expiry(model)
        if math.isinf(model.keep_alive) or model.borrowed:
            return
        loop = asyncio.get_running_loop()
        model.expiry = loop.call_later(max(0.0, model.keep_alive), self._expire, model)

    def _expire(self, model: ServedModel) -> None:
        model.expiry = None
        if model.evictable:
            log.info("model %s idle for its keep-alive (%gs): unloading", model.name,
                     model.keep_alive)
            self._start(model, "unloading", self._unload(model))

    # ---- the server's end --------------------------------------------------------------
    def stop(self) -> None:
        """Stops every runtime the pool owns (the server's end; multi-host: the other
        processes stop too)."""
        for model in self.models.values():
            self._cancel_expiry(model)
            if not model.borrowed:
                model.runtime.stop()
        if self.channel is not None:
            self.channel.close()

    def follower_engine(self, name: str) -> Any:
        """A follower process's engine of model `name`, which process 0 loads now: read,
        placed and warmed up as process 0's (called on the follower's replay thread)."""
        model = self.models.get(name)
        if model is None:
            raise RuntimeError(f"process 0 loads {name!r}, which this process does not serve: "
                               "start every process with the same --model flags")
        runtime = ModelRuntime(model.settings)
        engine = runtime.load_engine()
        if model.settings.warmup_mode != "none":
            engine.warmup()
        log.info("process %d: %s loaded, replaying process 0's calls",
                 self.settings.process_id, name)
        return engine

    def rows(self) -> list[dict[str, Any]]:
        """Every model's `ServedModel.describe()`, the primary first."""
        return [m.describe() for m in self.models.values()]


def _retrieve(task: asyncio.Task) -> None:
    """Marks a finished operation's error as seen (its awaiters got it already)."""
    if not task.cancelled():
        task.exception()


def _collect() -> None:
    """Frees what an unloaded model left: its arrays, then malloc's free memory."""
    gc.collect()
    release_free_memory()


__all__ = ["STATES", "ModelPool", "ServedModel"]
