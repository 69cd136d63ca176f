"""The scheduler's LoRA registry: which adapter name holds which engine LoRA slot.

Loads and unloads are queued by any thread and run on the loop thread (`run_ops`), between
steps: writing a slot is a program of the engine (nothing compiles). An unloaded adapter's
name is refused at once, and its slot is cleared once no queued or running request uses it.
Each load gets its own prefix-cache key (`name#load`), so pages of an adapter unloaded and
loaded again under the same name are never reused. The active mix (`set_active`) is what a
request that names no adapter is served with.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from metrale_jax.errors import BusyError, InvalidParameterError
from metrale_jax.scheduler.sequence import Sequence

LoraMix = tuple[tuple[str, float], ...]
"""A request's adapters: (name, weight) pairs."""


class LoraRegistry:
    """Adapter names, their engine slots and prefix-cache keys, and the queued loads/unloads.

    Args:
        engine: the `Engine` whose LoRA slots (`config.max_loras`, `set_lora`) these are.
        adapters: adapters (`weights.lora.LoraAdapter`) by name, loaded into the slots in
            order by `load_initial` (on the loop thread, after warmup).
        wake: the scheduler's condition: its lock guards the registry's shared state, and it
            is notified when an operation is queued.
        running: whether the scheduler still accepts work (called with `wake`'s lock held).

    Attributes:
        slots: name -> engine LoRA slot of every loaded adapter.
        keys: name -> the adapter's prefix-cache key (which load it is).
        active: the mix a request that names none gets (`set_active`).
    """

    def __init__(self, engine: Any, adapters: dict[str, Any] | None,
                 wake: threading.Condition, running: Callable[[], bool]):
        adapters = dict(adapters or {})
        if adapters and len(adapters) > engine.config.max_loras:
            raise InvalidParameterError(
                f"{len(adapters)} LoRA adapters for {engine.config.max_loras} slots "
                "(max_loras)", param="loras")
        self.engine = engine
        self._wake = wake
        self._running = running
        self._initial = adapters
        self.slots = {name: i for i, name in enumerate(adapters)}
        self._loads = itertools.count()
        self.keys = {name: f"{name}#{next(self._loads)}" for name in adapters}
        self._unloading: dict[str, Future] = {}  # name -> the caller's future
        self.active: LoraMix = ()
        self._ops: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being unloaded (the loop may sleep)."""
        return not self._ops and not self._unloading

    def mix(self, lora: LoraMix | None) -> LoraMix:
        """A request's adapters, (name, weight) pairs without zero weights: its own choice, or
        the active mix when it made none (None). Raises when one is not loaded."""
        mix = self.active if lora is None else lora
        for name, _ in mix:
            if name not in self.slots or name in self._unloading:
                known = ", ".join(sorted(set(self.slots) - set(self._unloading))) or "none"
                why = "is being unloaded" if name in self._unloading else "is not loaded"
                raise InvalidParameterError(
                    f"the LoRA adapter {name!r} {why} (loaded: {known})", param="lora")
        return tuple((name, float(w)) for name, w in mix if w != 0)

    def for_request(self, lora: LoraMix | None) -> tuple[tuple[tuple[int, float], ...],
                                                          str | None]:
        """A request's adapters as its `Sequence` takes them: ((engine slot, weight) pairs,
        the prefix-cache key of that mix, None without adapters)."""
        mix = self.mix(lora)
        return (tuple((self.slots[name], w) for name, w in mix),
                ",".join(f"{self.keys[name]}*{w!r}" for name, w in mix) or None)

    def set_active(self, mix: dict[str, float]) -> None:
        """Sets the adapters a request that names none is served with: {name: weight}; {}
        for the base model. Requests already queued keep the adapters they were given."""
        with self._wake:
            self.active = self.mix(tuple(mix.items()))

    def load(self, name: str, adapter: Any) -> Future:
        """Queues loading `adapter` into a free slot under `name` (run on the loop thread).
        The future gives the slot, or raises `InvalidParameterError` when the name is taken
        or every slot holds an adapter."""
        return self._queue(lambda: self._load(name, adapter))

    def unload(self, name: str) -> Future:
        """Unloads adapter `name`: new requests for it are refused at once; the future ends
        when the last request using it has ended and its slot is cleared."""
        future: Future = Future()
        with self._wake:
            if name not in self.slots or name in self._unloading:
                future.set_exception(InvalidParameterError(
                    f"no LoRA adapter {name!r} is loaded", param="lora_name"))
            else:
                self._unloading[name] = future  # from now on `mix` refuses it
                self.active = tuple((n, w) for n, w in self.active if n != name)
                self._wake.notify()
        return future

    def load_initial(self) -> None:
        """Writes the adapters given at construction into their slots (loop thread)."""
        for name, adapter in self._initial.items():
            self.engine.set_lora(self.slots[name], adapter)

    def run_ops(self, users: Callable[[], Iterable[Sequence]]) -> None:
        """Runs queued loads and unloads (loop thread); clears the slots of unloaded adapters
        that none of `users()` (the queued and running sequences) uses."""
        while self._ops:
            fn, future = self._ops.popleft()
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
        if not self._unloading:
            return
        seqs = list(users())
        for name, future in list(self._unloading.items()):
            slot = self.slots[name]
            if any(uses_slot(s, slot) for s in seqs):
                continue
            self.engine.set_lora(slot, None)
            del self.slots[name], self.keys[name], self._unloading[name]
            future.set_result(None)

    def _queue(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._wake:
            if not self._running():
                raise BusyError("the scheduler is stopped")
            self._ops.append((fn, future))
            self._wake.notify()
        return future

    def _load(self, name: str, adapter: Any) -> int:
        if name in self.slots:
            raise InvalidParameterError(f"a LoRA adapter named {name!r} is already loaded",
                                        param="lora_name")
        used = set(self.slots.values())
        free = [i for i in range(self.engine.config.max_loras) if i not in used]
        if not free:
            raise InvalidParameterError(
                f"all {self.engine.config.max_loras} LoRA slots hold adapters (--max-loras); "
                "unload one first", param="lora_name")
        self.engine.set_lora(free[0], adapter)
        self.keys[name] = f"{name}#{next(self._loads)}"
        self.slots[name] = free[0]
        return free[0]


def uses_slot(seq: Sequence, lora_slot: int) -> bool:
    """Whether `seq` is served with the adapter in engine LoRA slot `lora_slot`."""
    return any(slot == lora_slot for slot, _ in seq.lora)
