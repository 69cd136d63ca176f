"""Compiled programs kept on disk and loaded without tracing: what makes a warm start load.

JAX's persistent compilation cache (`compilation_cache.py`) skips XLA's compile on a second
start, but every program is still traced and lowered first, since its key is a hash of the
lowered module: for the default model about a quarter of a warm start's program time (the
sampler alone traces in ~0.3 s). `ExecutableStore` keeps each `ProgramCache` program's
serialized executable (`jax.experimental.serialize_executable`) under a key made of the
program's own key and input specs and of an engine *fingerprint* (everything else a program
depends on): the source of `metrale_jax` (every .py, .cc and .h file), the versions of jax and
jaxlib, the backend and its devices, XLA_FLAGS and the METRALE_ environment, the engine and
model configs, and which CPU kernels are available (their check also registers them, which a
loaded program needs before it runs). Any change makes new keys: a stale program is never
loaded. Entries are written whole or not at all (a temporary file renamed into place), so a
process killed mid-write leaves the store usable (its temporary file is removed when the next
store opens the folder); an entry that fails to load (a truncated file fails to unpickle) is
dropped and the program compiled and stored again. Serializing and loading hold
`compilation_cache.SERIALIZE_LOCK` (one (de)serialization at a time in the process: XLA:CPU
aborted when two overlapped) and happen on the compiling thread before the program is
published, so an executable is never serialized while it runs.

On by default in the compilation cache's folder (`EngineConfig.compilation_cache_dir`, its
`executables/` subfolder), where it replaces JAX's persistent cache for the engine's programs:
an engine with a store does not turn JAX's cache on, because an executable JAX loaded from its
cache cannot be serialized again whole (`compile_fresh` checks, and such a program is never
stored). `METRALE_EXECUTABLE_CACHE=0` turns the store off and JAX's cache back on (the test
suite does, and tests the store on its own); a multi-process run never uses it (each process
must compile the same programs in step).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import jax

from metrale_jax.engine.compilation_cache import (
    SERIALIZE_LOCK,
    remove_stale_temporaries,
    temporary_name,
)

log = logging.getLogger(__name__)

SWITCH = "METRALE_EXECUTABLE_CACHE"
"""The environment variable that turns the store off ("0", "false", "off", "no")."""
PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def source_digest() -> str:
    """sha256 of every .py, .cc and .h file of the `metrale_jax` package (path and bytes)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def kernel_modules() -> list[Any]:
    """Every C++ kernel module of `metrale_jax.kernels` (those with an `available()`), found
    by listing the package: a stored program may call any of them, so a kernel added later
    cannot be left out of the fingerprint nor left unregistered before a program is loaded."""
    import importlib
    import pkgutil

    import metrale_jax.kernels as package
    found = [importlib.import_module(f"{package.__name__}.{info.name}")
             for info in pkgutil.iter_modules(package.__path__)]
    return [m for m in found if callable(getattr(m, "available", None))]


def _kernels() -> str:
    """Which CPU kernels this process has (registered as a side effect: a stored program that
    calls one cannot be loaded before its FFI target is), on CPU only."""
    if jax.default_backend() != "cpu":
        return ""
    return ",".join(f"{m.__name__}={m.available()}" for m in kernel_modules())


def enabled() -> bool:
    """False when METRALE_EXECUTABLE_CACHE says off, or in a multi-process run."""
    off = os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    return not off and jax.process_count() == 1


def fingerprint(*parts: Any) -> str:
    """The engine fingerprint of the module docstring, with `parts` (e.g. the engine and
    model configs) added by their repr."""
    import jaxlib
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("METRALE_", "XLA_", "JAX_")) and k != SWITCH)
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    h = hashlib.sha256()
    for part in (source_digest(), jax.__version__, jaxlib.__version__, devices, env,
                 _kernels(), *parts):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def specs_signature(specs: Any) -> str:
    """The tree structure, shapes, dtypes and shardings of a program's input specs."""
    leaves, tree = jax.tree.flatten(specs)
    return repr((str(tree), [(getattr(s, "shape", None), str(getattr(s, "dtype", None)),
                              repr(getattr(s, "sharding", None))) for s in leaves]))


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()  # per thread: did the compile being made hit JAX's cache?
_listening = False


def _on_event(event: str, **_: Any) -> None:
    if event == _JAX_CACHE_HIT:
        _compiling.hit = True


_PERSISTENT_CACHE_LOCK = threading.RLock()
"""Held around a compile while JAX's persistent cache is on: XLA:CPU (jaxlib 0.10.2) aborted
the process when one thread deserialized a cached executable while another serialized a new
one (seen in a clean-clone test run: `put_executable_and_time` beside
`get_executable_and_time`, "Fatal Python error: Aborted"). Since then every (de)serialization
also holds `compilation_cache.SERIALIZE_LOCK` (JAX's get/put on any thread, eager ops
included, and this store's), which is what keeps two from overlapping; this lock stays as
it was (it only orders the engine's own compiles with JAX's cache on, the test suite's
configuration)."""


def compile_fresh(lower: Any) -> tuple[Any, bool]:
    """`lower().compile()`, and whether XLA compiled it now (False: JAX's persistent cache
    gave a deserialized executable, which `serialize` cannot write again whole: loaded, it
    fails at run time with "Function ... not found", so the store never keeps one). With
    JAX's persistent cache on, one compile at a time per process (`_PERSISTENT_CACHE_LOCK`)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    guard = (_PERSISTENT_CACHE_LOCK if jax.config.jax_compilation_cache_dir
             else contextlib.nullcontext())
    with guard:
        _compiling.hit = False
        exe = lower().compile()
        return exe, not _compiling.hit


class ExecutableStore:
    """Serialized executables in `folder`, keyed under an engine `fingerprint`."""

    def __init__(self, folder: str | Path, fingerprint_: str):
        self.folder = Path(folder).expanduser()
        self.fingerprint = fingerprint_
        self.loaded = 0  # programs loaded from the store so far
        self._lock = threading.Lock()
        remove_stale_temporaries(self.folder)

    def path(self, key: tuple, specs: Any) -> Path:
        """The file of program `key` with input `specs`."""
        h = hashlib.sha256(f"{self.fingerprint}|{key!r}|{specs_signature(specs)}".encode())
        return self.folder / f"{h.hexdigest()}.exe"

    def load(self, key: tuple, specs: Any) -> Any | None:
        """The stored executable of `key` / `specs`, or None (missing, or unreadable: then
        dropped)."""
        from jax.experimental.serialize_executable import deserialize_and_load
        path = self.path(key, specs)
        try:
            payload = path.read_bytes()
        except OSError:
            return None
        try:
            with SERIALIZE_LOCK:
                exe = deserialize_and_load(*pickle.loads(payload))
        except Exception as e:
            log.warning("dropping unreadable stored program %s (%s): %s", key, path.name, e)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            self.loaded += 1
        return exe

    def save(self, key: tuple, specs: Any, exe: Any) -> None:
        """Stores `exe`, the executable of `key` / `specs` (written to a temporary file and
        renamed into place; a failure is logged and ignored)."""
        from jax.experimental.serialize_executable import serialize
        path = self.path(key, specs)
        tmp = temporary_name(path)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with SERIALIZE_LOCK:
                payload = pickle.dumps(serialize(exe))
            tmp.write_bytes(payload)
            os.replace(tmp, path)
        except Exception as e:
            log.warning("could not store program %s: %s", key, e)
            tmp.unlink(missing_ok=True)


__all__ = ["SWITCH", "ExecutableStore", "compile_fresh", "enabled", "fingerprint",
           "source_digest", "specs_signature"]
