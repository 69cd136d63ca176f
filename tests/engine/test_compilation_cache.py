"""The persistent compilation cache survives a killed writer (engine/compilation_cache.py):
writes are atomic, a torn entry is recompiled and rewritten, a dead writer's temporary file is
removed on the next start."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache
from jax._src.lru_cache import LRUCache

from metrale_jax.engine import compilation_cache

DEAD_PID = 4_194_305  # above Linux's largest pid_max: no process has it


def test_an_entry_appears_whole_and_a_put_replaces_it(tmp_path):
    compilation_cache.enable(None)  # no folder: changes nothing
    compilation_cache._write_atomically()  # what enable(folder) installs (idempotent)
    cache = LRUCache(str(tmp_path / "c"), max_size=-1)
    value = bytes(range(256)) * 4096
    cache.put("k1", value)
    assert cache.get("k1") == value
    # JAX puts only after a miss or an unreadable entry: the put replaces what is there
    # (a torn entry left by a killed process is rewritten).
    (tmp_path / "c" / "k1-cache").write_bytes(value[:1000])
    cache.put("k1", value)
    assert cache.get("k1") == value
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["k1-cache"], names  # the temporary file was renamed into place


def test_a_dead_writers_temporary_file_is_removed(tmp_path):
    dead = tmp_path / f".k1-cache.{DEAD_PID}.7.tmp"
    mine = tmp_path / f".k2-cache.{os.getpid()}.7.tmp"  # a write of this process, under way
    other = tmp_path / ".not-ours.tmp"
    for path in (dead, mine, other):
        path.write_bytes(b"half an entry")
    assert compilation_cache.remove_stale_temporaries(tmp_path) == 1
    assert not dead.exists() and mine.exists() and other.exists()


@pytest.fixture
def own_cache(tmp_path):
    """JAX's persistent cache in a folder of this test's own (the suite's afterwards)."""
    before = jax.config.jax_compilation_cache_dir
    folder = tmp_path / "jax-cache"
    compilation_cache.enable(str(folder))
    jax_cache.reset_cache()
    yield folder
    jax.config.update("jax_compilation_cache_dir", before)
    jax_cache.reset_cache()


def _run(x: np.ndarray, offset: float) -> tuple[np.ndarray, list[str]]:
    """A fresh jit of one program (as a new process would compile it) and the cache
    warnings it raised."""
    jax.clear_caches()
    jax_cache.reset_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = np.asarray(jax.jit(lambda v: jnp.sin(v) * 3 + offset)(x))
    return out, [str(w.message) for w in caught if "compilation cache" in str(w.message)]


def test_a_torn_entry_is_compiled_again_and_rewritten(own_cache):
    offset = float(1 + os.getpid() % 1000)  # a program no cache has seen
    x = np.arange(8.0, dtype=np.float32)
    want, warned = _run(x, offset)
    assert not warned
    entries = {p: p.stat().st_size for p in own_cache.glob("jit__lambda*-cache")}
    assert entries, "nothing was cached"
    for path, size in entries.items():  # a process killed while writing in place
        path.write_bytes(path.read_bytes()[: size // 2])
    got, warned = _run(x, offset)  # the next start: no crash, the same answer
    np.testing.assert_array_equal(got, want)
    assert warned, "the torn entries were read without a warning"
    for path, size in entries.items():  # rewritten whole
        assert path.stat().st_size > size // 2, path.name
    again, warned = _run(x, offset)  # and read back
    np.testing.assert_array_equal(again, want)
    assert not warned, warned
    assert not list(own_cache.glob(".*.tmp"))


def held_elsewhere() -> bool:
    """Whether another thread holds SERIALIZE_LOCK now (asked from a thread of its own)."""
    import threading
    free: list[bool] = []

    def probe():
        got = compilation_cache.SERIALIZE_LOCK.acquire(blocking=False)
        free.append(got)
        if got:
            compilation_cache.SERIALIZE_LOCK.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return not free[0]


def test_jax_serializes_and_deserializes_under_the_lock(own_cache, monkeypatch):
    seen: list[tuple[str, bool]] = []
    plain_get, plain_put = LRUCache.get, LRUCache.put

    def get(self, key):
        out = plain_get(self, key)
        if out is not None:  # a hit: JAX deserializes it next, in the same locked call
            seen.append(("get", held_elsewhere()))
        return out

    def put(self, key, value):  # JAX serialized the executable just before
        seen.append(("put", held_elsewhere()))
        return plain_put(self, key, value)

    monkeypatch.setattr(LRUCache, "get", get)
    monkeypatch.setattr(LRUCache, "put", put)
    offset = float(2000 + os.getpid() % 1000)
    x = np.arange(4.0, dtype=np.float32)
    first, _ = _run(x, offset)  # a miss: put
    second, _ = _run(x, offset)  # a hit: get
    np.testing.assert_array_equal(first, second)
    assert ("put", True) in seen and ("get", True) in seen, seen
    assert all(held for _, held in seen), seen
