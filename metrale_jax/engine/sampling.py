"""Per-slot sampling on the device: greedy, temperature, top-k, top-p and min-p.

Every setting is an array with one entry per slot (`SamplingState`), so no request compiles
anything. Row `b` is drawn with the key `fold_in(keys[b], steps[b])`, so a seeded request gives
the same tokens whatever else is in the batch.

Semantics (the order transformers applies its warpers in):
1. `process_logits` (the one place for logits processors: penalties, biases, masks).
2. temperature 0 = greedy (argmax of the processed logits); otherwise `x = logits / T`.
3. top-k keeps the k largest `x` (0 = off); top-p then keeps, in descending order, each token
   whose preceding probability mass (renormalised over the top-k set) is below `top_p`; min-p
   keeps tokens with `p >= min_p * p_max` (a ratio, so it commutes with renormalising).
4. The draw is Gumbel-max over the kept set with noise indexed by token id (a hash of the
   row's step key and the id), so the result does not depend on how the kept set was found:
   a row whose kept set lies within its candidates draws over those only.

Finding the kept set without sorting all `V` logits: top-k/top-p are applied to the `CANDIDATES`
largest logits (`lax.top_k`) and turned into a threshold on `x`. When a slot's kept set may
reach beyond the candidates (top_k > CANDIDATES, or a nucleus wider than them) that slot takes
its threshold from a full sort instead, computed only when some slot needs it (`lax.cond`).
Either way each slot's threshold depends on its own logits only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

CANDIDATES = 256
"""How many of the largest logits the top-k/top-p fast path looks at."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Per-slot sampling settings, all arrays with a leading `B` (slots) axis.

    temperature: [B] float32, 0 = greedy.  top_k: [B] int32, 0 = off.
    top_p: [B] float32 in (0, 1].  min_p: [B] float32 in [0, 1].
    keys: [B, 2] uint32, raw threefry key data of each slot's seed.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array

    @classmethod
    def host_defaults(cls, batch: int) -> SamplingState:
        """Greedy settings for `batch` slots, as NumPy arrays."""
        return cls(temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                   top_p=np.ones(batch, np.float32), min_p=np.zeros(batch, np.float32),
                   keys=np.zeros((batch, 2), np.uint32))

    def set_rows(self, rows: jax.Array, other: SamplingState) -> SamplingState:
        """Rows `rows: [R] int32` replaced by `other` ([R] rows); out of range: dropped."""
        return jax.tree.map(lambda a, b: a.at[rows].set(b.astype(a.dtype), mode="drop"),
                            self, other)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """One sampled token per row: tokens [B] int32, logprobs [B] float32 (model's raw
    log-softmax), top_ids [B, N] int32 and top_logprobs [B, N] float32."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def seed_to_key(seed: int) -> np.ndarray:
    """The raw `[2] uint32` key data for an integer seed (64 bits are kept)."""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def process_logits(logits: jax.Array, sampling: SamplingState) -> jax.Array:
    """Logits processors: `logits [B, V] float32 -> [B, V] float32`.

    The one place for repetition/frequency/presence penalties, logit biases and token masks
    (they will read their per-slot arrays from `sampling`). Identity for now.
    """
    del sampling
    return logits


def _kept_from_sorted(vals: jax.Array, lse: jax.Array, k_eff: jax.Array, top_p: jax.Array,
                      mass_known: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Applies top-k then top-p to descending `vals: [B, C]`.

    lse: [B] log-sum-exp of the full row, so `exp(vals - lse)` are true probabilities.
    Returns (the number of kept tokens [B] int32, the smallest kept value [B]).
    """
    C = vals.shape[-1]
    probs = jnp.exp(vals - lse[:, None])
    in_k = jnp.arange(C)[None, :] < k_eff[:, None]
    pk = jnp.where(in_k, probs, 0.0)
    mass = jnp.sum(pk, axis=-1)
    if mass_known is not None:  # top-k off: the renormalising mass is the whole row's, 1
        mass = jnp.where(mass_known, mass, 1.0)
    before = jnp.cumsum(pk, axis=-1) - pk
    keep = in_k & (before < (top_p * mass)[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1).astype(jnp.int32)
    thresh = jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=-1)[:, 0]
    return n_keep, thresh


def _thresholds(x: jax.Array, sampling: SamplingState):
    """Each row's kept-set floor on tempered logits `x: [B, V]`, and its candidates.

    Returns (floor [B]: the kept set is `x >= floor`; in_candidates [B] bool: the row's kept
    set lies within its CANDIDATES largest logits; vals, ids [B, C]: those candidates, valid
    where in_candidates).
    """
    B, V = x.shape
    C = min(CANDIDATES, V)
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    uses_kp = (k_eff < V) | (top_p < 1.0)
    lse = jax.nn.logsumexp(x, axis=-1)

    def candidate_threshold(_):
        vals, ids = jax.lax.top_k(x, C)
        n_keep, thresh = _kept_from_sorted(vals, lse, k_eff, top_p, k_eff <= C)
        covered = (k_eff <= C) | ((k_eff == V) & (n_keep < C))
        return thresh, covered, vals, ids.astype(jnp.int32)

    def none_threshold(_):
        return (jnp.full((B,), -jnp.inf, x.dtype), jnp.ones((B,), bool),
                jnp.zeros((B, C), x.dtype), jnp.zeros((B, C), jnp.int32))

    thresh_c, covered, vals, ids = jax.lax.cond(jnp.any(uses_kp), candidate_threshold,
                                                none_threshold, None)
    need_full = uses_kp & ~covered

    def full_threshold(_):
        sorted_vals = -jnp.sort(-x, axis=-1)
        return _kept_from_sorted(sorted_vals, lse, k_eff, top_p, None)[1]

    thresh_f = jax.lax.cond(jnp.any(need_full), full_threshold,
                            lambda _: jnp.full((B,), -jnp.inf, x.dtype), None)
    thresh = jnp.where(uses_kp, jnp.where(covered, thresh_c, thresh_f), -jnp.inf)
    x_max = jnp.max(x, axis=-1)
    floor = jnp.maximum(thresh, x_max + jnp.log(min_p))  # log(0) = -inf: min-p off
    return floor, uses_kp & covered, vals, ids


def kept_mask(x: jax.Array, sampling: SamplingState) -> jax.Array:
    """The drawable tokens `[B, V] bool` of tempered logits `x: [B, V]` under each row's
    top-k, top-p and min-p (temperature is already applied; greedy rows are not special)."""
    floor = _thresholds(x, sampling)[0]
    return x >= floor[:, None]


def _token_noise(key_data: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise for token ids `ids: [N]` under one row's step key (`[2] uint32` data):
    one threefry hash of (key, token id) each, so drawing over a subset of the vocabulary
    gives the same token as drawing over all of it."""
    # The raw threefry primitive on counter pairs (id, 0): each output depends on its own
    # id only (`threefry_2x32` pairs up the two halves of its input instead).
    ids = ids.astype(jnp.uint32)
    bits, _ = threefry2x32_p.bind(key_data[0], key_data[1], ids, jnp.zeros_like(ids))
    # 23 random mantissa bits -> a uniform in (0, 1), never 0 or 1.
    u = (jax.lax.shift_right_logical(bits, jnp.uint32(9)).astype(jnp.float32) + 0.5) * (
        1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


def _draw(x: jax.Array, sampling: SamplingState, steps: jax.Array) -> jax.Array:
    """Gumbel-max draw from tempered logits `x: [B, V]` over the kept set; returns [B] int32.

    Noise is indexed by token id. A row whose kept set lies within its candidates (top-k ≤
    CANDIDATES, or a nucleus inside them: the usual case) draws over those C tokens only;
    other rows draw over the whole vocabulary, computed only when some row needs it.
    """
    B, V = x.shape
    floor, in_cand, vals, ids = _thresholds(x, sampling)
    keep = x >= floor[:, None]
    cand_keep = vals >= floor[:, None]
    # Ties at the floor outside the candidates would be drawable too: then use the full path.
    in_cand &= jnp.sum(keep, axis=-1) == jnp.sum(cand_keep, axis=-1)
    row_keys = jax.vmap(lambda k, s: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(k), s)))(sampling.keys, steps)
    g_c = jax.vmap(_token_noise)(row_keys, ids)
    tok_c = jnp.take_along_axis(
        ids, jnp.argmax(jnp.where(cand_keep, vals + g_c, -jnp.inf), axis=-1)[:, None],
        axis=-1)[:, 0]

    def full(_):
        all_ids = jnp.arange(V, dtype=jnp.int32)
        g = jax.vmap(lambda k: _token_noise(k, all_ids))(row_keys)
        return jnp.argmax(jnp.where(keep, x + g, -jnp.inf), axis=-1).astype(jnp.int32)

    tok_f = jax.lax.cond(jnp.any(~in_cand), full, lambda _: jnp.zeros((B,), jnp.int32), None)
    return jnp.where(in_cand, tok_c, tok_f).astype(jnp.int32)


def sample(logits: jax.Array, sampling: SamplingState, steps: jax.Array,
           num_top: int) -> SampleResult:
    """Samples one token per row.

    logits: [B, V] float32 (the model's); steps: [B] int32, the step index folded into each
    row's key. Returns the tokens, their log-probability under the model's raw distribution,
    and the top `num_top` tokens of that distribution.
    """
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top)
    proc = process_logits(logits, sampling)
    greedy = jnp.argmax(proc, axis=-1).astype(jnp.int32)
    t = sampling.temperature
    hot = t > 0

    def draw(_):
        x = proc / jnp.where(hot, t, 1.0)[:, None]
        return jnp.where(hot, _draw(x, sampling, steps), greedy)

    tokens = jax.lax.cond(jnp.any(hot), draw, lambda _: greedy, None)
    logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleResult(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)
