"""The leader's engine as its `Scheduler` sees it: each call that runs a program, and each
host-side page call, is sent to the followers first, then made on the leader's own engine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from metrale_jax.errors import MetraleError, PeerLostError
from metrale_jax.multihost.channel import LeaderChannel
from metrale_jax.multihost.wire import encode


class LeaderEngine:
    """The leader's engine as its `Scheduler` sees it: `init_decode_state`, `add` and `step`
    are sent to the followers, then run; everything else is the engine's own. A call that
    fails while (or just before) a follower goes away raises that `PeerLostError` instead
    (a collective with a dead peer fails with a runtime error that says nothing of it)."""

    LOST_WAIT_S = 2.0  # how long a failed call waits for the watchdog's verdict

    def __init__(self, engine: Any, channel: LeaderChannel):
        self.engine = engine
        self.channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state_free = args[1:] if op != "init" else ()
        self.channel.send({"op": op, "args": encode(list(state_free)),
                           "kwargs": encode(kwargs)})
        try:
            return fn(*args, **kwargs)
        except MetraleError:
            raise
        except Exception as e:
            lost = self.channel.lost(self.LOST_WAIT_S)
            if lost is not None:
                raise lost from e
            raise

    def init_decode_state(self):
        """`Engine.init_decode_state`, on every process."""
        return self._call("init", self.engine.init_decode_state)

    def add(self, state, *args: Any, **kwargs: Any):
        """`Engine.add`, on every process (the state stays each process's own)."""
        return self._call("add", self.engine.add, state, *args, **kwargs)

    def step(self, state, *args: Any, **kwargs: Any):
        """`Engine.step`, on every process."""
        return self._call("step", self.engine.step, state, *args, **kwargs)

    def verify(self, state, active: Any, allowed: Any, drafts: list[list[int]]):
        """`Engine.verify` (speculative decoding), on every process."""
        return self._call("verify", self.engine.verify, state, active, allowed,
                          [[int(t) for t in d] for d in drafts])

    def beam_set(self, state, *args: Any):
        """`Engine.beam_set`, on every process."""
        return self._call("beam_set", self.engine.beam_set, state,
                          *[[list(x) for x in arg] for arg in args])

    def _host(self, op: str, *args: Any) -> Any:
        """A host-side page call (`PAGE_CALLS`), on every process (their page tables and
        prefix caches stay the same)."""
        # A lost peer: the requests are failing and the server exits; the next step raises.
        with contextlib.suppress(PeerLostError):
            self.channel.send({"op": op, "args": encode(list(args)), "kwargs": encode({})})
        return getattr(self.engine, op)(*args)

    def set_lora(self, slot: int, adapter: Any | None) -> None:
        """`Engine.set_lora`, on every process: each reads the adapter from its own path (as
        each loads the model), then runs the program that writes the slot."""
        path = None if adapter is None else adapter.path
        name = None if adapter is None else adapter.name
        return self._call("set_lora", lambda *_: self.engine.set_lora(slot, adapter), None,
                          slot, path, name)

    def release(self, slot: int) -> None:
        """`Engine.release`, on every process."""
        self._host("release", slot)

    def reuse_prefix(self, slot: int, keys: list[str], budget: int) -> int:
        """`Engine.reuse_prefix`, on every process."""
        return self._host("reuse_prefix", slot, list(keys), budget)

    def reserve(self, slot: int, length: int) -> bool:
        """`Engine.reserve`, on every process."""
        return self._host("reserve", slot, length)

    def cache_pages(self, slot: int, first: int, keys: list[str]) -> int:
        """`Engine.cache_pages`, on every process."""
        return self._host("cache_pages", slot, first, list(keys))

    def fork(self, moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """`Engine.fork`, on every process; returns its page copies."""
        return self._host("fork", [list(m) for m in moves])

