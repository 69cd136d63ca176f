"""The CPU int4 matmul kernel: `y [M, N] = x [M, K] @ w [N, K]^T` for 4-bit weights in
llama.cpp's Q4_1 block form, as an XLA FFI call.

`x` float32; `q [N, K / 2]` uint8, two 4-bit codes a byte (block b's byte j: element 32b + j
low, 32b + 16 + j high); `dm [N, K / 32, 2]` float16, each 32-element block's scale and
minimum, `w = d * q + m` (`models/quant4.py` holds the format). The C++ is `int4_matmul.cc`
beside this file, built on first use by `kernels/build.py` and registered with XLA for the
"cpu" platform. It reads each packed weight byte once per call for small M (decode, verify).

`available()` says whether the kernel can be used in this process (it builds, loads and
registers it once; a failed build logs one warning and answers False, so callers keep the
XLA form); `METRALE_INT4_KERNEL=0` turns it off. `METRALE_INT8_KERNEL_THREADS=n` caps the
threads of XLA's intra-op pool a call uses, as for the int8 kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from metrale_jax.kernels.build import switched_on, try_register
from metrale_jax.kernels.int8_matmul import max_threads

SOURCE = Path(__file__).with_name("int4_matmul.cc")
TARGET = "metrale_int4_matmul"


def enabled() -> bool:
    """False when `METRALE_INT4_KERNEL` is "0" (or "false"/"off"/"no")."""
    return switched_on("METRALE_INT4_KERNEL")


@functools.cache
def _load() -> bool:
    """Builds (or finds cached), loads and registers the kernel once; False on failure."""
    return try_register(SOURCE, {TARGET: "MetraleInt4Matmul"}, "int4 matmuls use XLA's form")


def available() -> bool:
    """Whether the kernel is enabled and built: registers it on the first True answer (call
    this before tracing a program that uses it)."""
    return enabled() and _load()


def int4_matmul(x: jax.Array, q: jax.Array, dm: jax.Array) -> jax.Array:
    """`x [M, K] @ w [N, K]^T` -> float32 `[M, N]` for the packed `q [N, K / 2]` uint8 and
    `dm [N, K / 32, 2]` float16 (see the module docstring). Needs `available()`."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), q, dm.astype(jnp.float16), max_threads=max_threads())


__all__ = ["SOURCE", "TARGET", "available", "enabled", "int4_matmul"]
