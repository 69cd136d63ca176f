"""Token sets as bitmasks: `[..., ceil(V / 32)]` uint32 words, bit `v % 32` of word `v // 32`.

The layout is llguidance's (and llama.cpp's grammar masks'), so one format carries the
per-slot banned tokens, the min_tokens stop tokens, DRY's sequence breakers and, later,
grammar masks. Packing happens on the host (NumPy); unpacking on the device (JAX).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np


def words_for(vocab_size: int) -> int:
    """The number of uint32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """A `[rows, ceil(V/32)]` uint32 bitmask that allows every token."""
    return np.full((rows, words_for(vocab_size)), 0xFFFFFFFF, np.uint32)


def pack(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """A `[words_for(V)]` uint32 bitmask with the bits of `ids` set (ids outside [0, V) are
    ignored)."""
    ids = np.fromiter((i for i in ids if 0 <= i < vocab_size), np.int64)
    words = np.zeros(words_for(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words


def unpack(words: jax.Array, vocab_size: int) -> jax.Array:
    """`words: [..., W] uint32 -> [..., V] bool` (the inverse of `pack`)."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words[..., :, None] >> shifts) & jnp.uint32(1)
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(jnp.bool_)


def unpack_np(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """NumPy version of `unpack`."""
    shifts = np.arange(32, dtype=np.uint32)
    bits = (words[..., :, None] >> shifts) & np.uint32(1)
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(np.bool_)
