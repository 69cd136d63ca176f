"""The persistent compilation cache's writes are atomic (engine/compilation_cache.py)."""

from __future__ import annotations

from jax._src.lru_cache import LRUCache

from metrale_jax.engine import compilation_cache


def test_an_entry_appears_whole_or_not_at_all(tmp_path):
    compilation_cache.enable(None)  # no folder: changes nothing
    compilation_cache._write_atomically()  # what enable(folder) installs (idempotent)
    cache = LRUCache(str(tmp_path / "c"), max_size=-1)
    value = bytes(range(256)) * 4096
    cache.put("k1", value)
    assert cache.get("k1") == value
    cache.put("k1", b"other")  # an existing entry is kept, as JAX does
    assert cache.get("k1") == value
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["k1-cache"], names  # the temporary file was renamed into place
