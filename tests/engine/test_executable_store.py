"""Compiled programs stored beside the persistent cache load without tracing and run exactly as
compiled ones (engine/executable_store.py); a changed config never loads them; a torn entry is
dropped and compiled again; an executable JAX's own cache gave is never stored."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.engine import SlotSettings
from metrale_jax.engine.executable_store import ExecutableStore, compile_fresh
from metrale_jax.models.transformer import Transformer
from tests.engine.conftest import TINY, make_engine

PROMPTS = [[3, 1, 4, 1, 5], list(range(2, 42))]  # the second: two chunks of 32


@pytest.fixture
def store_on(monkeypatch):
    """The store on and JAX's persistent cache off, as an engine with a store runs (the
    suite's cache would hand back executables that the store must not keep)."""
    from jax._src import compilation_cache as jax_cache
    monkeypatch.setenv("METRALE_EXECUTABLE_CACHE", "1")
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    jax_cache.reset_cache()


def _run(engine) -> list[int]:
    """Greedy and seeded tokens of two prompts, one after the other, a few steps each."""
    state = engine.init_decode_state()
    tokens = []
    for prompt, settings in zip(PROMPTS, (SlotSettings(), SlotSettings(temperature=0.8,
                                                                      top_p=0.9, seed=5)),
                                strict=True):
        state, first = engine.add(state, [(0, prompt, settings)])
        tokens.append(int(np.asarray(first.tokens)[0, 0]))
        for _ in range(4):
            state, out = engine.step(state, np.ones(1, np.bool_))
            tokens.append(int(np.asarray(out.tokens)[0, 0]))
    return tokens


def test_a_second_engine_loads_every_program_and_runs_the_same(store_on):
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(1)))
    first = make_engine(TINY, graphdef, params, max_slots=1, max_prefill_batch=1)
    assert first.programs.store is not None
    first.warmup()
    expected = _run(first)
    second = make_engine(TINY, graphdef, params, max_slots=1, max_prefill_batch=1)
    second.warmup()
    assert second.programs.store.loaded == second.compile_count == first.compile_count
    assert _run(second) == expected
    other = make_engine(TINY, graphdef, params, max_slots=1, max_prefill_batch=1,
                        num_top_logprobs=3)
    assert other.programs.store.fingerprint != second.programs.store.fingerprint
    spec = other.step_programs.state_spec
    assert other.programs.store.path(("init",), spec) != second.programs.store.path(("init",),
                                                                                    spec)


def test_an_unreadable_entry_is_dropped_and_compiled_again(tmp_path):
    store = ExecutableStore(tmp_path, "fingerprint")
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    offset = float(time.time_ns() % 1_000_003)  # a program no cache has seen
    exe, fresh = compile_fresh(lambda: jax.jit(lambda x: x * 2 + offset).lower(spec))
    assert fresh
    # The suite's JAX persistent cache has it now: a second compile is a load, which
    # serializes incompletely, so the store must be told not to keep it.
    assert not compile_fresh(lambda: jax.jit(lambda x: x * 2 + offset).lower(spec))[1]
    store.save(("double",), (spec,), exe)
    path = store.path(("double",), (spec,))
    loaded = store.load(("double",), (spec,))
    assert loaded is not None and store.loaded == 1
    np.testing.assert_array_equal(loaded(jnp.arange(4.0)),
                                  np.arange(4.0, dtype=np.float32) * 2 + offset)
    path.write_bytes(path.read_bytes()[:100])  # torn, as by a crash before the rename
    assert store.load(("double",), (spec,)) is None and not path.exists()
    assert store.load(("other",), (spec,)) is None  # missing
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_torn_entry_and_a_dead_writers_file_are_cleaned_and_rewritten(tmp_path, store_on,
                                                                         monkeypatch):
    import jax.experimental.serialize_executable as serialization

    from tests.engine.test_compilation_cache import held_elsewhere
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    offset = float(time.time_ns() % 1_000_003)
    store = ExecutableStore(tmp_path, "fingerprint")
    exe, fresh = compile_fresh(lambda: jax.jit(lambda x: x - offset).lower(spec))
    assert fresh
    locked = []
    plain = serialization.serialize
    monkeypatch.setattr(serialization, "serialize",
                        lambda e: (locked.append(held_elsewhere()), plain(e))[1])
    store.save(("minus",), (spec,), exe)
    assert locked == [True]  # serialized under compilation_cache.SERIALIZE_LOCK
    path = store.path(("minus",), (spec,))
    path.write_bytes(path.read_bytes()[:-7])  # cut short
    leftover = path.with_name(f".{path.name}.4194305.1.tmp")  # a writer killed mid-write
    leftover.write_bytes(b"half")
    store = ExecutableStore(tmp_path, "fingerprint")  # the next start
    assert not leftover.exists()
    assert store.load(("minus",), (spec,)) is None and not path.exists()
    store.save(("minus",), (spec,), exe)  # compiled again, stored again
    loaded = store.load(("minus",), (spec,))
    np.testing.assert_array_equal(loaded(jnp.arange(4.0)),
                                  np.arange(4.0, dtype=np.float32) - offset)


def test_every_cpu_kernel_is_registered_before_a_program_loads():
    """A stored program calling a C++ kernel loads only once that kernel's FFI target is
    registered (a fresh process loading a program with `metrale_chunk_attention` before
    anything registered it dropped every stored program: "No FFI handler registered"). The
    store registers (and fingerprints) every kernel module of the package, one per source."""
    from pathlib import Path

    import metrale_jax.kernels as package
    from metrale_jax.engine.executable_store import kernel_modules
    sources = {p.stem for p in Path(package.__path__[0]).glob("*.cc")}
    assert sources and {m.__name__.rsplit(".", 1)[1] for m in kernel_modules()} == sources
