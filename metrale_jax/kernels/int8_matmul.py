"""The CPU int8 matmul kernel: `y [M, N] = (x [M, K] @ q) * scale [N]` as an XLA FFI call.

`x` and `scale` float32, `q` int8 in the [in, out] layout `[K, N]` or, `transposed`, `[N, K]`
(a tied embedding used as the LM head); the C++ is `int8_matmul.cc` beside this file, built on
first use by `kernels/build.py` and registered with XLA for the "cpu" platform. Each weight
byte is read once per call for small M (decode, verify), where XLA:CPU's
`x @ q.astype(float32)` is several times slower than a float32 dot (docs/quantization.md, "int8 weights").

`available()` says whether the kernel can be used in this process: it builds, loads and
registers it once (a failed build logs one warning and answers False, so callers keep the XLA
form); `METRALE_INT8_KERNEL=0` turns it off. `METRALE_INT8_KERNEL_THREADS=n` caps the threads
of XLA's intra-op pool one call uses (default 0: the pool's size).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from metrale_jax.kernels.build import switched_on, try_register

SOURCE = Path(__file__).with_name("int8_matmul.cc")
TARGETS: dict[bool, str] = {False: "metrale_int8_matmul_kn", True: "metrale_int8_matmul_nk"}
"""FFI target name by `transposed` (q [N, K])."""
_SYMBOLS: dict[bool, str] = {False: "MetraleInt8MatmulKN", True: "MetraleInt8MatmulNK"}


def enabled() -> bool:
    """False when `METRALE_INT8_KERNEL` is "0" (or "false"/"off"/"no")."""
    return switched_on("METRALE_INT8_KERNEL")


@functools.cache
def _load() -> bool:
    """Builds (or finds cached), loads and registers the kernel once; False on failure."""
    return try_register(SOURCE, {target: _SYMBOLS[t] for t, target in TARGETS.items()},
                        "int8 matmuls use XLA's slower form")


def available() -> bool:
    """Whether the kernel is enabled and built: registers it on the first True answer (call
    this before tracing a program that uses it)."""
    return enabled() and _load()


def max_threads() -> int:
    """`METRALE_INT8_KERNEL_THREADS` (0, the default, lets a call use XLA's whole pool)."""
    return int(os.environ.get("METRALE_INT8_KERNEL_THREADS", "0") or 0)


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array,
                transposed: bool = False) -> jax.Array:
    """`(x [M, K] @ q [K, N]) * scale [N]` (or `q [N, K]` contracted on its K when
    `transposed`) -> float32 `[M, N]`; x and scale float32, q int8. Needs `available()`."""
    n = q.shape[0] if transposed else q.shape[1]
    call = jax.ffi.ffi_call(TARGETS[transposed],
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), q, scale.astype(jnp.float32),
                max_threads=max_threads())


__all__ = ["SOURCE", "TARGETS", "available", "enabled", "int8_matmul", "max_threads"]
