"""The CPU paged decode attention kernel: one query per row against its cached pages, as an
XLA FFI call (`decode_attention.cc` beside this file, built on first use by `kernels/build.py`).

XLA:CPU runs `models.paged_attention.decode_attention`'s block loop at about 20 to 40 µs per
row and 64-position block (each block's gather and small products): on the default model a
third of a single-stream decode step. The kernel reads each cached key and value once, in
place, per (row, kv head), with an online softmax; a row's arithmetic depends on that row
alone, so its result is the same in any batch.

`available()` builds, loads and registers it once (a failed build logs one warning and
answers False, and callers keep XLA's loop); `METRALE_DECODE_ATTENTION_KERNEL=0` turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.kernels.build import switched_on, try_register

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "metrale_decode_attention"
TARGET_INT8 = "metrale_decode_attention_int8"  # pages of int8 rows with scales (kv_quant.py)


def enabled() -> bool:
    """False when `METRALE_DECODE_ATTENTION_KERNEL` is "0" (or "false"/"off"/"no")."""
    return switched_on("METRALE_DECODE_ATTENTION_KERNEL")


@functools.cache
def _load() -> bool:
    """Builds (or finds cached), loads and registers the kernel once; False on failure."""
    return try_register(SOURCE, {TARGET: "MetraleDecodeAttention",
                                 TARGET_INT8: "MetraleDecodeAttentionInt8"},
                        "XLA's loop is used")


def available() -> bool:
    """Whether the kernel is enabled and built (registers it on the first True answer: call
    this before tracing a program that uses it)."""
    return enabled() and _load()


def decode_attention(q: jax.Array, pages: jax.Array, table: jax.Array, lens: jax.Array, *,
                     sm_scale: float, sliding_window: int | None,
                     soft_cap: float | None) -> jax.Array:
    """`models.paged_attention.decode_attention`'s contract on the kernel: q `[n, H, D]`,
    pages `[N, ps, 2K, D]` float32 or `[N, ps, 2K, D + 4]` int8 (rows with their scales,
    `models/kv_quant.py`), table `[n, PPS]`, lens `[n]` (0: idle row, output 0); returns
    `[n, H, D]` float32. Needs `available()`."""
    target = TARGET_INT8 if pages.dtype == jnp.int8 else TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q.astype(jnp.float32), pages, table.astype(jnp.int32), lens.astype(jnp.int32),
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
                window=np.int64(sliding_window or 0))


__all__ = ["SOURCE", "TARGET", "TARGET_INT8", "available", "decode_attention", "enabled"]
