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
4. The draw is Gumbel-max over the full vocabulary restricted to the kept set: noise is indexed
   by token id, so the result does not depend on how the kept set was found.

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


def kept_mask(x: jax.Array, sampling: SamplingState) -> jax.Array:
    """The drawable tokens `[B, V] bool` of tempered logits `x: [B, V]` under each row's
    top-k, top-p and min-p (temperature is already applied; greedy rows are not special)."""
    B, V = x.shape
    C = min(CANDIDATES, V)
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    uses_kp = (k_eff < V) | (top_p < 1.0)
    lse = jax.nn.logsumexp(x, axis=-1)

    def candidate_threshold(_):
        vals, _ = jax.lax.top_k(x, C)
        n_keep, thresh = _kept_from_sorted(vals, lse, k_eff, top_p, k_eff <= C)
        covered = (k_eff <= C) | ((k_eff == V) & (n_keep < C))
        return thresh, covered

    def none_threshold(_):
        return jnp.full((B,), -jnp.inf, x.dtype), jnp.ones((B,), bool)

    thresh_c, covered = jax.lax.cond(jnp.any(uses_kp), candidate_threshold, none_threshold, None)
    need_full = uses_kp & ~covered

    def full_threshold(_):
        vals = -jnp.sort(-x, axis=-1)
        return _kept_from_sorted(vals, lse, k_eff, top_p, None)[1]

    thresh_f = jax.lax.cond(jnp.any(need_full), full_threshold,
                            lambda _: jnp.full((B,), -jnp.inf, x.dtype), None)
    thresh = jnp.where(uses_kp, jnp.where(covered, thresh_c, thresh_f), -jnp.inf)
    x_max = jnp.max(x, axis=-1)
    floor = jnp.maximum(thresh, x_max + jnp.log(min_p))  # log(0) = -inf: min-p off
    return x >= floor[:, None]


def _draw(x: jax.Array, sampling: SamplingState, steps: jax.Array) -> jax.Array:
    """Gumbel-max draw from tempered logits `x: [B, V]` over `kept_mask`; returns [B] int32."""
    V = x.shape[-1]
    keep = kept_mask(x, sampling)

    def noise(key_data: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
        return jax.random.gumbel(key, (V,), jnp.float32)

    g = jax.vmap(noise)(sampling.keys, steps)
    return jnp.argmax(jnp.where(keep, x + g, -jnp.inf), axis=-1).astype(jnp.int32)


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
