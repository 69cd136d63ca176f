"""The per-slot arrays that sampling reads: settings (`SamplingState`) and the token history
that penalties need (`TokenHistory`).

Every request setting is data with a leading slots axis, so no request compiles anything.
Sizes that must be static (how many logit biases or bad words a request may carry, the
history windows) are the constants below; requests beyond them get a 400 on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.engine.bitmask import words_for

MAX_LOGIT_BIAS = 256
"""Entries of `logit_bias` one request may carry."""
MAX_BAD_WORDS = 32
"""Multi-token `bad_words` sequences (after tokenizing each word's variants) per request."""
MAX_BAD_WORD_TOKENS = 16
"""Tokens of one bad-word sequence."""
DRY_WINDOW = 1024
"""DRY looks for repeats in at most the last this many tokens (`dry_penalty_last_n = -1`,
the whole context, means the whole context up to this window)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Per-slot sampling settings, all arrays with a leading `R` (rows: slots) axis.

    Drawing: temperature [R] f32 (0 = greedy); top_k [R] i32 (0 = off); top_p [R] f32 in
    (0, 1]; min_p [R] f32 in [0, 1]; typical_p [R] f32 (1 = off); xtc_threshold,
    xtc_probability [R] f32 (probability 0 = off); keys [R, 2] uint32 (raw threefry data of
    the slot's seed).
    Penalties: repetition_penalty [R] (1 = off); presence_penalty, frequency_penalty [R]
    (0 = off); dry_multiplier [R] (0 = off), dry_base [R], dry_allowed_length [R] i32,
    dry_last_n [R] i32 (-1 = whole window, 0 = off); lz_penalty [R] (0 = off);
    top_n_sigma [R] f32 (<= 0 = off).
    Token sets: bias_ids [R, MAX_LOGIT_BIAS] i32 (V = unused entry) with bias_values
    [R, MAX_LOGIT_BIAS] f32; banned, stop_ids, dry_breakers [R, ceil(V/32)] uint32 bitmasks
    (always banned; masked while fewer than min_tokens [R] i32 are generated; DRY's sequence
    breakers); bad_words [R, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] i32, each sequence
    right-aligned (-1 before it) with its length in bad_word_lens [R, MAX_BAD_WORDS] i32
    (0 = unused).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    dry_multiplier: jax.Array
    dry_base: jax.Array
    dry_allowed_length: jax.Array
    dry_last_n: jax.Array
    lz_penalty: jax.Array
    top_n_sigma: jax.Array
    typical_p: jax.Array
    xtc_threshold: jax.Array
    xtc_probability: jax.Array
    min_tokens: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    banned: jax.Array
    stop_ids: jax.Array
    dry_breakers: jax.Array
    bad_words: jax.Array
    bad_word_lens: jax.Array

    @classmethod
    def host_defaults(cls, rows: int, vocab_size: int) -> SamplingState:
        """Greedy settings with every control off for `rows` rows, as NumPy arrays."""
        f32, i32 = np.float32, np.int32
        W = words_for(vocab_size)

        def full(value, dtype, *shape):
            return np.full((rows, *shape), value, dtype)

        return cls(
            temperature=full(0, f32), top_k=full(0, i32), top_p=full(1, f32),
            min_p=full(0, f32), keys=full(0, np.uint32, 2),
            repetition_penalty=full(1, f32), presence_penalty=full(0, f32),
            frequency_penalty=full(0, f32), dry_multiplier=full(0, f32),
            dry_base=full(1.75, f32), dry_allowed_length=full(2, i32), dry_last_n=full(-1, i32),
            lz_penalty=full(0, f32), top_n_sigma=full(0, f32), typical_p=full(1, f32),
            xtc_threshold=full(0.1, f32), xtc_probability=full(0, f32), min_tokens=full(0, i32),
            bias_ids=full(vocab_size, i32, MAX_LOGIT_BIAS),
            bias_values=full(0, f32, MAX_LOGIT_BIAS),
            banned=full(0, np.uint32, W), stop_ids=full(0, np.uint32, W),
            dry_breakers=full(0, np.uint32, W),
            bad_words=full(-1, i32, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS),
            bad_word_lens=full(0, i32, MAX_BAD_WORDS))

    @classmethod
    def device_defaults(cls, rows: int, vocab_size: int) -> SamplingState:
        """`host_defaults` as JAX arrays (usable inside a traced function)."""
        return jax.tree.map(jnp.asarray, cls.host_defaults(rows, vocab_size))

    def set_rows(self, rows: jax.Array, other: SamplingState) -> SamplingState:
        """Rows `rows: [R'] int32` replaced by `other` ([R'] rows); out of range: dropped."""
        return jax.tree.map(lambda a, b: a.at[rows].set(b.astype(a.dtype), mode="drop"),
                            self, other)


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
