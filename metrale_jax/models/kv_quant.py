"""The int8 KV cache: keys and values stored int8, one float32 scale per token and head.

A page pool of cache dtype int8 is `[N, ps, 2K, D + 4]` int8. Each row `[t, h]` (a token's key
head or value head, interleaved as in float pools: key head j at 2j, value head j at 2j + 1)
holds its D values quantized symmetrically, `round(x / s)` in -127 .. 127 with
`s = max|x| / 127`, followed by the 4 bytes of `s` (float32, bitcast). A row reads back as
`q * s`, within `s / 2` of what was written in every element.

The scale lives beside its row in the same array, so an int8 pool is still one array per layer:
pages are written, read in place, copied (beam forks, copy-on-write), shared by the prefix
cache and sharded over the kv heads exactly as float pages are; only the code that reads or
writes a row's values (`models/paged_attention.py`, the CPU decode kernel) knows the layout.
A float pool stores rows as they come (`stored_head_dim(D, dtype) == D`).

Per (token, head) scales follow JetStream's int8 KV cache: one outlier costs its own row's
precision only, and a row's bytes do not depend on any other token, so quantizing keeps the
engine's batch invariance (a row's stored bytes are the same alone or in any batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_BYTES = 4  # a float32 scale at the end of every int8 row

__all__ = ["SCALE_BYTES", "as_stored", "dequantize_rows", "head_dim_of", "is_quantized",
           "quantize_rows", "stored_head_dim"]


def is_quantized(dtype) -> bool:
    """Whether a pool of `dtype` holds int8 rows with scales (else rows as they come)."""
    return jnp.dtype(dtype) == jnp.int8


def stored_head_dim(head_dim: int, dtype) -> int:
    """The last dimension of a pool of `dtype` for heads of `head_dim`: D + 4 for int8."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(pages: jax.Array) -> int:
    """D, the head dim of a pool `[N, ps, 2K, D (+ 4 for int8)]`."""
    return pages.shape[-1] - (SCALE_BYTES if is_quantized(pages.dtype) else 0)


def quantize_rows(x: jax.Array) -> jax.Array:
    """Rows `[..., D]` (float) -> `[..., D + 4]` int8: each row's values over its scale
    `max|x| / 127` (rounded to nearest, in -127 .. 127), then the scale's float32 bytes. A row
    of zeros gets scale 0 (and reads back as zeros)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    q = jnp.clip(q, -127, 127).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8)  # [..., 4]
    return jnp.concatenate([q, scale_bytes], axis=-1)


def dequantize_rows(packed: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Int8 rows `[..., D + 4]` -> `[..., D]` in `dtype` (`q * s`); float rows unchanged (cast
    to `dtype`)."""
    if not is_quantized(packed.dtype):
        return packed.astype(dtype)
    scale = jax.lax.bitcast_convert_type(packed[..., -SCALE_BYTES:], jnp.float32)  # [...]
    values = packed[..., :-SCALE_BYTES].astype(jnp.float32) * scale[..., None]
    return values.astype(dtype)


def as_stored(x: jax.Array, dtype) -> jax.Array:
    """Rows `[..., D]` as a pool of `dtype` gives them back: quantized and read back for int8
    (so a step's fresh keys attend as later steps will read them), unchanged otherwise."""
    if not is_quantized(dtype):
        return x
    return dequantize_rows(quantize_rows(x), x.dtype)
