"""JAX's persistent compilation cache, made safe for processes that share its folder.

JAX's file cache writes an entry in place (`Path.write_bytes`) and takes no lock unless the
cache has a size bound. A process that reads an entry another process is still writing gets a
truncated executable, and loading one crashes the reader (a segfault, not an exception). Test
workers, the processes of a multi-host server on one machine, or two servers sharing
`~/.cache/metrale/jax` do exactly that when they compile the same program at the same time.
(A size bound would add the lock, but then every write scans the whole folder, thousands of
entries, to decide what to evict.)

`enable(folder)` turns the cache on for every compile and makes each write atomic: the entry
is written to a temporary file beside it and renamed into place (`os.replace`), so a reader
sees the whole entry or none.
"""

from __future__ import annotations

import os
import threading

import jax

_patched = False


def enable(folder: str | None) -> None:
    """Turns on JAX's persistent compilation cache in `folder` for every compile, small or
    fast ones included (CPU compiles are quick but many), with atomic writes. None leaves the
    setting alone."""
    if folder is None:
        return
    folder = os.path.expanduser(folder)
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _write_atomically()


def _write_atomically() -> None:
    """Replaces `LRUCache.put` (unbounded caches only) with write-then-rename. If JAX's
    internals have moved, the cache keeps JAX's own writes."""
    global _patched
    if _patched:
        return
    try:
        from jax._src import lru_cache
        cache_cls, suffix = lru_cache.LRUCache, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):
        return
    plain_put = cache_cls.put

    def put(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not key:
            return plain_put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return None
        tmp = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(value)
        os.replace(tmp, path)
        return None

    cache_cls.put = put
    _patched = True
