"""The KV cache: one pytree of keys and values for every layer, slot and position.

Layout `[L, B, K, S, D]`: per layer a `[B, K, S, D]` block, so attention is a batched matmul
over (slot, kv head) with the sequence axis contiguous. Position `s` of slot `b` holds the key of
the token at position `s`; a slot whose next token is at position `p` has `0 .. p-1` valid.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig

# Logical axis names of the cache, beside its shape; engine/sharding.py maps them to the mesh.
KV_CACHE_AXES: tuple[str, ...] = ("layers", "slots", "kv_heads", "seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer. k, v: `[L, B, K, S, D]` in the cache dtype."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, slots: int, length: int, dtype=jnp.float32) -> KVCache:
        """An empty cache for `slots` sequences of up to `length` tokens."""
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, length, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def length(self) -> int:
        """S, the number of positions per slot."""
        return self.k.shape[3]

    def write(self, new_k: jax.Array, new_v: jax.Array, positions: jax.Array) -> KVCache:
        """Writes one step's keys and values into the cache.

        new_k, new_v: `[L, B, K, T, D]`; positions: `[B, T] int32`, where token t of slot b
        goes. Positions outside `0 .. S-1` are dropped (padding of a prefill bucket).
        """
        B = new_k.shape[1]
        b = jnp.arange(B)[:, None]  # [B, 1] broadcasts against positions [B, T]
        pos = positions

        def put(cache: jax.Array, new: jax.Array) -> jax.Array:
            # cache[:, b, :, pos] has shape [B, T, L, K, D] (advanced indices first).
            upd = new.transpose(1, 3, 0, 2, 4).astype(cache.dtype)
            return cache.at[:, b, :, pos].set(upd, mode="drop")

        return KVCache(put(self.k, new_k), put(self.v, new_v))
