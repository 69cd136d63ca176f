"""Giving freed host memory back to the operating system.

glibc's malloc keeps what a process frees in its arenas for later allocations, and a few large
frees never return: loading a checkpoint (GGUF blocks dequantized to float32, then quantized
again or cast) and compiling programs (XLA's compiler allocates and frees millions of objects)
leave hundreds of MB resident that nothing uses. Measured on the default model, int4,
4 slots: 842 MB resident after loading, 397 MB after `release_free_memory()`; after warmup,
2,265 MB and 2,022 MB (bench/program_memory.py). Under another allocator (jemalloc preloaded,
as the test suite does) or off Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where there is none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Returns the memory freed in the process's malloc arenas to the system (glibc's
    `malloc_trim(0)`); True when it released any. Safe to call from any thread, at any time."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))


__all__ = ["release_free_memory"]
