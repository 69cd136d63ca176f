"""Compile a C++ source of this package into a shared library on first use, cached per user.

`build(source)` runs the system `g++ -O3 -march=native -shared -fPIC -std=c++17` with JAX's
FFI headers and the source's folder (its shared `.h` files) on the include path into
`<cache>/<stem>-<key>.so`, where the cache folder is `$METRALE_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/metrale_jax/kernels` (default `~/.cache/...`), and the key hashes
everything the binary depends on: the source and those headers, the jaxlib version, the
compiler and its flags,
`platform.machine()` and the CPU's feature flags (from /proc/cpuinfo: `-march=native` code may
not run on another CPU model sharing the cache folder). The library is written to a temporary
file in the same folder and renamed into place, so processes building at once never load a
half-written file. No new build backend: the .cc ships with the package as package data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CXX_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")


class BuildError(RuntimeError):
    """The library could not be built: no compiler, or it failed (the message says why)."""


def cache_dir() -> Path:
    """The folder built libraries are cached in (see the module docstring)."""
    if folder := os.environ.get("METRALE_KERNEL_CACHE"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metrale_jax" / "kernels"


def _cpu_flags() -> str:
    """The first "flags" (x86) or "Features" (arm) line of /proc/cpuinfo, or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return ""


def build_key(source: bytes, compiler: str) -> str:
    """A hash of what a library built from `source` by `compiler` depends on."""
    import jaxlib

    h = hashlib.sha256()
    for part in (source, jaxlib.__version__.encode(), compiler.encode(),
                 " ".join(CXX_FLAGS).encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(source: Path) -> Path:
    """The path of the shared library built from `source` (built now unless cached);
    raises `BuildError` when there is no g++ or the compile fails."""
    import jax

    compiler = os.environ.get("CXX") or shutil.which("g++")
    if not compiler:
        raise BuildError("no C++ compiler (g++ not found, CXX not set)")
    folder = cache_dir()
    text = source.read_bytes() + b"".join(h.read_bytes()
                                          for h in sorted(source.parent.glob("*.h")))
    out = folder / f"{source.stem}-{build_key(text, compiler)}.so"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        cmd = [compiler, *CXX_FLAGS, "-isystem", jax.ffi.include_dir(), "-I", str(source.parent),
               str(source), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def register(source: Path, targets: dict[str, str]) -> None:
    """Builds `source` (or finds it cached), loads it and registers each FFI target of
    `targets` (target name -> the handler symbol the library exports) with XLA:CPU. Raises
    `BuildError`, or OSError / AttributeError when the library or a symbol cannot be loaded."""
    import ctypes

    import jax

    lib = ctypes.cdll.LoadLibrary(str(build(source)))
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")


def try_register(source: Path, targets: dict[str, str], fallback: str) -> bool:
    """`register`, answering False (after one warning saying `fallback`, what callers use
    instead) when the library cannot be built or loaded."""
    try:
        register(source, targets)
    except (BuildError, OSError, AttributeError) as e:
        log.warning("%s unavailable, %s: %s", source.stem, fallback, e)
        return False
    return True


def switched_on(variable: str) -> bool:
    """False when the environment variable `variable` is "0", "false", "off" or "no"."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "off", "no")


__all__ = ["CXX_FLAGS", "BuildError", "build", "build_key", "cache_dir", "register",
           "switched_on", "try_register"]
