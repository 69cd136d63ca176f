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
sees the whole entry or none. An entry is written whenever JAX asks (it asks only after a miss
or an entry it could not read), replacing what is there: an entry cut short by a killed
process (JAX's own in-place write, or a disk that filled) is rewritten by the next compile of
that program. An entry that fails to load (a truncated zstd frame fails to decompress; JAX then
warns and compiles again) is removed at once. Temporary files a killed process left behind
are removed by `enable` (`remove_stale_temporaries`).

Serialization: XLA:CPU (jaxlib 0.10.2) aborted a test worker when one thread deserialized a
cached executable while another serialized one (`get_executable_and_time` beside
`put_executable_and_time`, "Fatal Python error: Aborted"). `SERIALIZE_LOCK` is held around
every serialization and deserialization of an executable in the process: JAX's cache
`get`/`put` (installed here, so eager ops compiled on any thread are covered) and the
executable store's (`executable_store.py`). It is held for the serialization and the file
write only, never for a compile, so a step waits at most for one entry's (de)serialization.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path

import jax

SERIALIZE_LOCK = threading.RLock()
"""Held around every serialization and deserialization of an executable in this process (see
the module docstring)."""

STALE_TEMPORARY_S = 24 * 3600.0
"""A temporary entry file older than this is removed even if its writer's pid is alive (the
pid may have been reused)."""

_TEMPORARY = re.compile(r"^\..+\.(\d+)\.(\d+)\.tmp$")  # .<entry>.<pid>.<thread>.tmp

_patched = False
_guarded = False


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
    remove_stale_temporaries(folder)
    _write_atomically()
    _guard_serialization()


def temporary_name(path: Path) -> Path:
    """The temporary file an entry `path` is written to before it is renamed into place:
    `.<name>.<pid>.<thread id>.tmp` beside it (the pid tells a dead writer's leftovers)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale_temporaries(folder: str | Path) -> int:
    """Removes the temporary entry files (`temporary_name`) in `folder` that a process killed
    mid-write left: those of a pid that no longer runs, or older than `STALE_TEMPORARY_S`.
    Returns how many were removed; errors are ignored (another process may remove them too)."""
    removed = 0
    now = time.time()
    try:
        candidates = [p for p in Path(folder).glob(".*.tmp") if _TEMPORARY.match(p.name)]
    except OSError:
        return 0
    for path in candidates:
        pid = int(_TEMPORARY.match(path.name).group(1))  # type: ignore[union-attr]
        with contextlib.suppress(OSError):
            if pid == os.getpid():
                continue
            if not _pid_alive(pid) or now - path.stat().st_mtime > STALE_TEMPORARY_S:
                path.unlink()
                removed += 1
    return removed


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
        # JAX puts only after a miss or an entry it could not read: replace whatever is
        # there (a torn entry is rewritten; another process's equal entry is harmless).
        path = self.path / f"{key}{suffix}"
        tmp = temporary_name(path)
        try:
            tmp.write_bytes(value)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        return None

    cache_cls.put = put
    _patched = True


def _guard_serialization() -> None:
    """Wraps JAX's persistent-cache `get_executable_and_time` and `put_executable_and_time`
    (where executables are deserialized and serialized) in `SERIALIZE_LOCK`; an entry that
    fails to load is removed before the error goes on (JAX warns and compiles again). If
    JAX's internals have moved, its own functions stay."""
    global _guarded
    if _guarded:
        return
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src import lru_cache
        plain_get, plain_put = jax_cache.get_executable_and_time, jax_cache.put_executable_and_time
        get_cache, suffix = jax_cache._get_cache, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):
        return

    def get_executable_and_time(cache_key: str, *args, **kwargs):
        with SERIALIZE_LOCK:
            try:
                return plain_get(cache_key, *args, **kwargs)
            except Exception:
                with contextlib.suppress(Exception):
                    cache = get_cache(args[1] if len(args) > 1 else kwargs.get("backend"))
                    folder = getattr(cache, "path", None)
                    if folder is not None and cache_key:
                        (Path(str(folder)) / f"{cache_key}{suffix}").unlink(missing_ok=True)
                raise

    def put_executable_and_time(*args, **kwargs):
        with SERIALIZE_LOCK:
            return plain_put(*args, **kwargs)

    jax_cache.get_executable_and_time = get_executable_and_time
    jax_cache.put_executable_and_time = put_executable_and_time
    _guarded = True
