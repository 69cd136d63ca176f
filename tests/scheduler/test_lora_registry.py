"""The scheduler's LoRA registry alone, on a fake engine: names, slots, cache keys, the
active mix, and loads/unloads run by the loop thread."""

from __future__ import annotations

import threading
import types

import pytest

from metrale_jax.errors import BusyError, InvalidParameterError
from metrale_jax.scheduler.lora_registry import LoraRegistry


class FakeEngine:
    """Records `set_lora` calls; `max_loras` slots."""

    def __init__(self, max_loras: int = 2):
        self.config = types.SimpleNamespace(max_loras=max_loras)
        self.calls: list[tuple[int, object]] = []

    def set_lora(self, slot: int, adapter: object) -> None:
        self.calls.append((slot, adapter))


def registry(adapters=None, max_loras: int = 2, running: bool = True):
    engine = FakeEngine(max_loras)
    return LoraRegistry(engine, adapters, threading.Condition(), lambda: running), engine


def test_requests_get_slots_weights_and_keys_of_their_load():
    reg, engine = registry({"a": "A", "b": "B"})
    reg.load_initial()
    assert engine.calls == [(0, "A"), (1, "B")]
    assert reg.for_request(None) == ((), None)
    assert reg.for_request((("b", 0.5), ("a", 0.0))) == (((1, 0.5),), "b#1*0.5")
    reg.set_active({"a": 2})
    assert reg.active == (("a", 2.0),)
    assert reg.for_request(None) == (((0, 2.0),), "a#0*2.0")
    with pytest.raises(InvalidParameterError, match="'c' is not loaded"):
        reg.mix((("c", 1.0),))
    with pytest.raises(InvalidParameterError, match="max_loras"):
        registry({"a": 1, "b": 2, "c": 3})


def test_an_unloaded_adapter_waits_for_its_users_and_a_new_load_gets_a_new_key():
    reg, engine = registry({"a": "A"})
    reg.set_active({"a": 1.0})
    user = types.SimpleNamespace(lora=((0, 1.0),))
    done = reg.unload("a")
    assert reg.active == () and not reg.idle
    with pytest.raises(InvalidParameterError, match="is being unloaded"):
        reg.mix((("a", 1.0),))
    reg.run_ops(lambda: [user])  # still used: the slot stays
    assert not done.done() and "a" in reg.slots
    reg.run_ops(list)
    assert done.result() is None and engine.calls == [(0, None)] and reg.idle
    loaded = reg.load("a", "A2")
    reg.run_ops(list)
    assert loaded.result() == 0 and reg.keys["a"] == "a#1"
    again = reg.load("a", "A3")  # queued; refused when run
    reg.run_ops(list)
    with pytest.raises(InvalidParameterError, match="already loaded"):
        again.result()
    with pytest.raises(InvalidParameterError, match="no LoRA adapter 'b'"):
        reg.unload("b").result()


def test_loads_are_refused_when_full_or_stopped():
    reg, _ = registry({"a": "A"}, max_loras=1)
    full = reg.load("b", "B")
    reg.run_ops(list)
    with pytest.raises(InvalidParameterError, match="all 1 LoRA slots"):
        full.result()
    stopped, _ = registry(running=False)
    with pytest.raises(BusyError):
        stopped.load("a", "A")
