"""The CPU prefill-chunk attention kernel: a chunk's tokens against their pieces' paged
context and their own chunk tokens, as an XLA FFI call (`chunk_attention.cc` beside this file,
built on first use by `kernels/build.py`).

XLA:CPU runs `models.paged_attention.chunk_attention`'s context loop (a gather, two small
products and the softmax per item and 256-position block) at a fraction of its matmuls'
speed. The kernel is flash attention over the pages: per (tile of a piece's queries, kv
head), blocks of 64 key positions packed once and multiplied with register-tiled
multiply-adds, an online softmax between the two products. A piece's result depends on that
piece alone, so it is the same beside any other pieces.

`available()` builds, loads and registers it once (a failed build logs one warning and
answers False, and callers keep XLA's loop); `METRALE_CHUNK_ATTENTION_KERNEL=0` turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.kernels.build import switched_on, try_register

SOURCE = Path(__file__).with_name("chunk_attention.cc")
TARGET = "metrale_chunk_attention"
TARGET_INT8 = "metrale_chunk_attention_int8"  # pages of int8 rows with scales (kv_quant.py)
Q_TILE = 128  # queries of one piece per task (bench/chunk_attention.py)


def enabled() -> bool:
    """False when `METRALE_CHUNK_ATTENTION_KERNEL` is "0" (or "false"/"off"/"no")."""
    return switched_on("METRALE_CHUNK_ATTENTION_KERNEL")


@functools.cache
def _load() -> bool:
    """Builds (or finds cached), loads and registers the kernel once; False on failure."""
    return try_register(SOURCE, {TARGET: "MetraleChunkAttention",
                                 TARGET_INT8: "MetraleChunkAttentionInt8"},
                        "XLA's loop is used")


def available() -> bool:
    """Whether the kernel is enabled and built (registers it on the first True answer: call
    this before tracing a program that uses it)."""
    return enabled() and _load()


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, tok_seq: jax.Array,
                    tok_pos: jax.Array, pages: jax.Array, table: jax.Array, *,
                    sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                    q_tile: int = Q_TILE) -> jax.Array:
    """`models.paged_attention.chunk_attention`'s contract on the kernel: q `[C, H, D]`;
    k, v `[C, K, D]` (the chunk's own keys and values); tok_seq `[C]` (-1: padding, output
    0), tok_pos `[C]`; pages `[N, ps, 2K, D]` float32 or `[N, ps, 2K, D + 4]` int8 (rows
    with their scales, `models/kv_quant.py`); table `[S, PPS]`; q_tile: queries per task.
    Returns `[C, H, D]` float32. Needs `available()`."""
    target = TARGET_INT8 if pages.dtype == jnp.int8 else TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    f32 = jnp.float32
    return call(q.astype(f32), k.astype(f32), v.astype(f32), tok_seq.astype(jnp.int32),
                tok_pos.astype(jnp.int32), pages, table.astype(jnp.int32),
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
                window=np.int64(sliding_window or 0), q_tile=np.int64(q_tile))


__all__ = ["Q_TILE", "SOURCE", "TARGET", "TARGET_INT8", "available", "chunk_attention",
           "enabled"]
