"""The per-slot arrays that sampling reads: settings (`SamplingState`) and the token history
that penalties need (`TokenHistory`).

Every request setting is data with a leading slots axis, so no request compiles anything.
`SamplingState`'s arrays are those of `metrale_jax.sampling_fields.DEVICE_ARRAYS` (dtype,
static shape, idle value, the row field that sets each). Sizes that must be static (how many
logit biases or bad words a request may carry, the history windows) are constants; requests
beyond them get a 400 on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.engine.bitmask import words_for
from metrale_jax.sampling_fields import (
    DEVICE_ARRAYS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    ROW_FIELDS,
    SAME,
    DeviceArray,
)

DRY_WINDOW = 1024
"""DRY looks for repeats in at most the last this many tokens (`dry_penalty_last_n = -1`,
the whole context, means the whole context up to this window)."""


def array_shape(a: DeviceArray, rows: int, vocab_size: int) -> tuple[int, ...]:
    """`[rows, *a.shape]` with the named sizes resolved ("W": ceil(V/32) bitmask words)."""
    named = {"W": words_for(vocab_size), "MAX_LOGIT_BIAS": MAX_LOGIT_BIAS,
             "MAX_BAD_WORDS": MAX_BAD_WORDS, "MAX_BAD_WORD_TOKENS": MAX_BAD_WORD_TOKENS}
    return (rows, *(named[d] if isinstance(d, str) else d for d in a.shape))


def idle_fill(a: DeviceArray, vocab_size: int) -> float | int:
    """The value of `a` in an idle row: its own, V, or its source row field's default."""
    if a.fill is SAME:
        return next(r.default for r in ROW_FIELDS if r.name == a.source)
    return vocab_size if a.fill == "V" else a.fill


def _host_defaults(cls, rows: int, vocab_size: int):
    """Greedy settings with every control off for `rows` rows, as NumPy arrays."""
    return cls(**{a.name: np.full(array_shape(a, rows, vocab_size), idle_fill(a, vocab_size),
                                  np.dtype(a.dtype)) for a in DEVICE_ARRAYS})


def _device_defaults(cls, rows: int, vocab_size: int):
    """`host_defaults` as JAX arrays (usable inside a traced function)."""
    return jax.tree.map(jnp.asarray, cls.host_defaults(rows, vocab_size))


def _set_rows(self, rows: jax.Array, other):
    """Rows `rows: [R'] int32` replaced by `other` ([R'] rows); out of range: dropped."""
    return jax.tree.map(lambda a, b: a.at[rows].set(b.astype(a.dtype), mode="drop"),
                        self, other)


def _docs() -> str:
    lines = [f"    {a.name}: [R{''.join(f', {d}' for d in a.shape)}] {a.dtype} (from "
             f"{a.source}{'; ' + a.doc if a.doc else ''})" for a in DEVICE_ARRAYS]
    return ("Per-slot sampling settings, all arrays with a leading `R` (rows: slots) axis.\n\n"
            "Arrays (from `metrale_jax.sampling_fields.DEVICE_ARRAYS`; W = ceil(V/32) bitmask "
            "words):\n" + "\n".join(lines) + "\n")


SamplingState = jax.tree_util.register_dataclass(dataclasses.make_dataclass(
    "SamplingState", [(a.name, jax.Array) for a in DEVICE_ARRAYS],
    namespace={"host_defaults": classmethod(_host_defaults),
               "device_defaults": classmethod(_device_defaults), "set_rows": _set_rows,
               "__doc__": _docs()}, frozen=True))
SamplingState.__module__ = __name__


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenHistory:
    """The tokens each slot has seen, for penalties.

    tokens: [R, N] int32, the sequence so far by position (prompt then generated; in the
    decode state N = S, the cache length; entries past the slot's length are stale);
    counts: [R, V] int32, how often each token was generated (the prompt not counted);
    prompt_seen: [R, V] bool, the tokens that occur in the prompt.
    """

    tokens: jax.Array
    counts: jax.Array
    prompt_seen: jax.Array

    @classmethod
    def of_prompts(cls, tokens: jax.Array, lengths: jax.Array, vocab_size: int) -> TokenHistory:
        """The history of freshly prefilled prompts: tokens [R, P] int32 with lengths [R]."""
        R, P = tokens.shape
        real = jnp.arange(P)[None, :] < lengths[:, None]
        ids = jnp.where(real, tokens, vocab_size)  # padding -> out of range, dropped
        seen = jnp.zeros((R, vocab_size), jnp.bool_).at[
            jnp.arange(R)[:, None], ids].set(True, mode="drop")
        return cls(tokens, jnp.zeros((R, vocab_size), jnp.int32), seen)

    @classmethod
    def zeros(cls, rows: int, length: int, vocab_size: int) -> TokenHistory:
        """An empty history of `rows` slots of `length` positions."""
        return cls(jnp.zeros((rows, length), jnp.int32),
                   jnp.zeros((rows, vocab_size), jnp.int32),
                   jnp.zeros((rows, vocab_size), jnp.bool_))

    def append(self, tokens: jax.Array, positions: jax.Array,
               advance: jax.Array | None = None) -> TokenHistory:
        """Records generated `tokens: [R]` at `positions: [R]` (>= N: not stored, but
        counted); rows with `advance: [R]` False are left as they are."""
        r = jnp.arange(tokens.shape[0])
        if advance is not None:
            positions = jnp.where(advance, positions, self.tokens.shape[1])  # dropped
        add = 1 if advance is None else advance.astype(jnp.int32)
        return TokenHistory(self.tokens.at[r, positions].set(tokens, mode="drop"),
                            self.counts.at[r, tokens].add(add, mode="drop"), self.prompt_seen)
