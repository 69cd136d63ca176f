"""Compiled programs stored beside the persistent cache load without tracing and run exactly as
compiled ones (engine/executable_store.py); a changed config never loads them; a torn entry is
dropped and compiled again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.engine import SlotSettings
from metrale_jax.engine.executable_store import ExecutableStore
from metrale_jax.models.transformer import Transformer
from tests.engine.conftest import TINY, make_engine

PROMPTS = [[3, 1, 4, 1, 5], list(range(2, 42))]  # the second: two chunks of 32


@pytest.fixture
def store_on(monkeypatch):
    monkeypatch.setenv("METRALE_EXECUTABLE_CACHE", "1")


def _run(engine) -> list[list[int]]:
    """Greedy and seeded tokens of two prompts over a few steps."""
    state = engine.init_decode_state()
    items = [(0, PROMPTS[0], SlotSettings()),
             (1, PROMPTS[1], SlotSettings(temperature=0.8, top_p=0.9, seed=5))]
    state, first = engine.add(state, items)
    tokens = [np.asarray(first.tokens)[0, :2].tolist()]
    active = np.arange(engine.config.max_slots) < 2
    for _ in range(4):
        state, out = engine.step(state, active)
        tokens.append(np.asarray(out.tokens)[0, :2].tolist())
    return tokens


def test_a_second_engine_loads_every_program_and_runs_the_same(store_on):
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(1)))
    first = make_engine(TINY, graphdef, params, max_slots=2)
    assert first.programs.store is not None
    first.warmup()
    expected = _run(first)
    second = make_engine(TINY, graphdef, params, max_slots=2)
    second.warmup()
    assert second.programs.store.loaded == second.compile_count == first.compile_count
    assert _run(second) == expected
    other = make_engine(TINY, graphdef, params, max_slots=2, num_top_logprobs=3)
    assert other.programs.store.fingerprint != second.programs.store.fingerprint
    other.step_programs.init()
    assert other.programs.store.loaded == 0  # another config: compiled, never loaded


def test_an_unreadable_entry_is_dropped_and_compiled_again(tmp_path):
    store = ExecutableStore(tmp_path, "fingerprint")
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    fn = jax.jit(lambda x: x * 2)
    store.save(("double",), (spec,), fn.lower(spec).compile())
    path = store.path(("double",), (spec,))
    loaded = store.load(("double",), (spec,))
    assert loaded is not None and store.loaded == 1
    np.testing.assert_array_equal(loaded(jnp.arange(4.0)), [0.0, 2.0, 4.0, 6.0])
    path.write_bytes(path.read_bytes()[:100])  # torn, as by a crash before the rename
    assert store.load(("double",), (spec,)) is None and not path.exists()
    assert store.load(("other",), (spec,)) is None  # missing
    assert not list(tmp_path.glob(".*.tmp"))
