"""Pooling an encoder's hidden states into one vector per input, as sentence-transformers'
`Pooling` and `Normalize` modules do (same float32 steps), run inside the encoder programs.

Modes: "cls" (the first token), "max" (per feature over the real tokens; pads count as
-1e9), "mean" (sum over the real tokens / max(count, 1e-9)), "mean_sqrt_len" (the sum over
sqrt(count)), "last" (the last real token; inputs are right-padded). Several modes are
concatenated in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

MODES = ("cls", "max", "mean", "mean_sqrt_len", "last")


def pool(hidden: jax.Array, lens: jax.Array, modes: Sequence[str]) -> jax.Array:
    """hidden `[B, S, E]`, lens `[B] int32` (real tokens per row, right-padded) ->
    `[B, E * len(modes)] float32`."""
    h = hidden.astype(jnp.float32)
    mask = (jnp.arange(h.shape[1])[None, :] < lens[:, None])[..., None]
    count = jnp.maximum(jnp.sum(mask.astype(jnp.float32), axis=1), 1e-9)
    total = jnp.sum(jnp.where(mask, h, 0.0), axis=1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(h[:, 0])
        elif mode == "max":
            out.append(jnp.max(jnp.where(mask, h, -1e9), axis=1))
        elif mode == "mean":
            out.append(total / count)
        elif mode == "mean_sqrt_len":
            out.append(total / jnp.sqrt(count))
        elif mode == "last":
            last = jnp.clip(lens - 1, 0, h.shape[1] - 1)
            out.append(jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=-1)


def l2_normalize(x: jax.Array) -> jax.Array:
    """`x / max(||x||, 1e-12)` per row (torch's `F.normalize`): `[B, E]` -> `[B, E]`."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
    return x / jnp.maximum(norm, 1e-12)


__all__ = ["MODES", "l2_normalize", "pool"]
