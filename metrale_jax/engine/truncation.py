"""The truncation samplers (top-k, top-p, min-p, typical-p, XTC) over descending logits.

`truncate` works on each row's `N` largest tempered logits, sorted: either the whole
vocabulary (N = V, after a full sort: exact for every row) or the row's top candidates
(N = CANDIDATES, cheap). On candidates a row's kept set is found exactly when it lies within
them (top-k <= N, or a nucleus / typical set / min-p floor that ends inside them); a row whose
kept set reaches beyond them is either a *band* `floor <= x <= ceil` over the whole
vocabulary (no top-k/top-p cut beyond the candidates, XTC's removed tokens all among them) or
is marked for the full sort. Each row's result depends on its own logits only.

Semantics, in order, each renormalising the probabilities over the tokens still kept:
- top_k keeps the k largest (0 = off); top_p then keeps, in descending order, each token whose
  preceding mass (over the top-k set) is below p; min_p keeps `p >= min_p * p_max`;
- typical_p (Meister et al., as llama.cpp): with H the entropy of the kept set, sort kept
  tokens by `|-log p - H|` ascending and keep the shortest prefix whose mass exceeds
  typical_p (at least one token);
- XTC (llama.cpp's): when the row's uniform draw `u <= xtc_probability` and
  `xtc_threshold <= 0.5`, and at least two kept tokens have `p >= xtc_threshold`, all of them
  but the least likely are removed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.engine.sampling_state import SamplingState

EXACT, BAND, NEEDS_FULL = 0, 1, 2
"""`KeptSet.mode` values."""


@dataclasses.dataclass(frozen=True)
class KeptSet:
    """One kept set per row.

    keep: [R, N] bool over the sorted positions; mode: [R] int32, EXACT (the kept set is
    `keep`), BAND (the kept set is `floor <= x <= ceil` over the vocabulary; `keep` holds its
    part among the candidates) or NEEDS_FULL; floor, ceil: [R] float32, the band.
    """

    keep: jax.Array
    mode: jax.Array
    floor: jax.Array
    ceil: jax.Array


def xtc_active(s: SamplingState, u: jax.Array) -> jax.Array:
    """[R] bool: XTC applies to the row this step (u: [R] uniforms in [0, 1))."""
    return (s.xtc_probability > 0) & (s.xtc_threshold <= 0.5) & (u <= s.xtc_probability)


def _masked_lse(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jax.nn.logsumexp(jnp.where(mask, x, -jnp.inf), axis=-1)


def _entropy(x: jax.Array, mask: jax.Array, lse: jax.Array) -> jax.Array:
    logp = x - lse[:, None]
    return -jnp.sum(jnp.where(mask, jnp.exp(logp) * logp, 0.0), axis=-1)


def truncate(s: jax.Array, x: jax.Array | None, sampling: SamplingState,
             u: jax.Array) -> KeptSet:
    """Kept sets of rows whose tempered logits, sorted descending, start with `s: [R, N]`.

    x: the full tempered logits [R, V] when `s` holds only the top N of them (candidates),
    None when `s` is the whole sorted row (then every row's mode is EXACT). u: [R] float32,
    the rows' XTC draws this step.
    """
    R, N = s.shape
    complete = x is None
    V = N if complete else x.shape[-1]
    j = jnp.arange(N)[None, :]
    finite = s > -jnp.inf
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p

    # top-k, top-p, min-p: a prefix of the sorted row.
    k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    lse_row = jax.nn.logsumexp(s if complete else x, axis=-1)
    in_k = j < k_eff[:, None]
    pk = jnp.where(in_k, jnp.exp(s - lse_row[:, None]), 0.0)
    mass = jnp.sum(pk, axis=-1)
    if not complete:  # top-k beyond the candidates is off in effect: the mass is the row's
        mass = jnp.where(k_eff <= N, mass, 1.0)
    before = jnp.cumsum(pk, axis=-1) - pk
    keep = in_k & ((top_p >= 1.0)[:, None] | (before < (top_p * mass)[:, None]))
    # Row ends by reductions, not slices: XLA:CPU folds slices of top_k's result into the sort
    # it lowers to, and then can't use its fast TopK kernel (a full sort costs ~50x more).
    first, last = jnp.max(s, axis=-1), jnp.min(s, axis=-1)
    floor_min_p = first + jnp.log(min_p)  # log(0) = -inf: min-p off
    keep &= (s >= floor_min_p[:, None]) & finite
    keep |= j == 0
    if complete:
        mode = jnp.full((R,), EXACT, jnp.int32)
    else:
        # Ends inside the candidates; a top-p cut there is only known when the top-k set's
        # mass is (top-k within the candidates, or off).
        within = (k_eff <= N) | ((jnp.sum(keep, axis=-1) < N) & ((k_eff >= V) | (top_p >= 1)))
        band = ~within & (k_eff >= V) & (top_p >= 1.0)
        mode = jnp.where(within, EXACT, jnp.where(band, BAND, NEEDS_FULL)).astype(jnp.int32)
    floor = jnp.where(mode == BAND, floor_min_p, -jnp.inf)
    ceil = jnp.full((R,), jnp.inf, s.dtype)
    typical = sampling.typical_p < 1.0
    xtc = xtc_active(sampling, u)

    def band_lse():
        if complete:
            return jnp.zeros((R,), s.dtype), jnp.zeros((R,), s.dtype)
        in_band = (x >= floor[:, None]) & (x > -jnp.inf)

        def compute(_):
            lse = _masked_lse(x, in_band)
            return lse, _entropy(x, in_band, lse)

        return jax.lax.cond(jnp.any((mode == BAND) & (typical | xtc)), compute,
                            lambda _: (jnp.zeros((R,), s.dtype),) * 2, None)

    lse_band, h_band = band_lse()

    def apply_typical(args):
        keep, mode = args
        lse = jnp.where(mode == BAND, lse_band, _masked_lse(s, keep))
        h = jnp.where(mode == BAND, h_band, _entropy(s, keep, lse))
        logp = s - lse[:, None]
        p = jnp.where(keep, jnp.exp(logp), 0.0)
        score = jnp.where(keep, jnp.abs(-logp - h[:, None]), jnp.inf)
        order = jnp.argsort(score, axis=-1, stable=True)
        cum = jnp.cumsum(jnp.take_along_axis(p, order, axis=-1), axis=-1)
        n_keep = jnp.sum(keep, axis=-1)
        n_below = jnp.sum(cum <= sampling.typical_p[:, None], axis=-1)  # stop at cum > p
        last = jnp.minimum(n_below, n_keep - 1)
        rank = jnp.zeros_like(order).at[jnp.arange(R)[:, None], order].set(
            jnp.broadcast_to(j, order.shape))
        keep_t = keep & (rank <= last[:, None])
        # A band row's typical set is exact when it ends inside the candidates and every
        # token beyond them scores worse: their -log p is at least the last candidate's.
        last_score = jnp.take_along_axis(jnp.sort(score, axis=-1), last[:, None], axis=-1)[:, 0]
        tail_bound = lse - last - h
        exact = (n_below < n_keep) & (last_score < tail_bound)
        new_mode = jnp.where(mode == BAND, jnp.where(exact, EXACT, NEEDS_FULL), mode)
        return (jnp.where(typical[:, None], keep_t, keep),
                jnp.where(typical, new_mode, mode).astype(jnp.int32))

    keep, mode = jax.lax.cond(jnp.any(typical), apply_typical, lambda a: a, (keep, mode))

    def apply_xtc(args):
        keep, mode, ceil = args
        lse = jnp.where(mode == BAND, lse_band, _masked_lse(s, keep))
        p = jnp.exp(s - lse[:, None])
        above = keep & (p >= sampling.xtc_threshold[:, None])
        n_above = jnp.sum(above, axis=-1)
        last_above = jnp.max(jnp.where(above, j, -1), axis=-1)
        act = xtc & (n_above >= 2)
        keep = jnp.where(act[:, None], keep & ~(above & (j < last_above[:, None])), keep)
        # A band row: every token at or above the threshold must be among the candidates.
        beyond = (mode == BAND) & act & (jnp.exp(last - lse) >= sampling.xtc_threshold)
        mode = jnp.where(beyond, NEEDS_FULL, mode).astype(jnp.int32)
        top_kept = jnp.take_along_axis(s, jnp.maximum(last_above, 0)[:, None], axis=-1)[:, 0]
        ceil = jnp.where(act & (mode == BAND), top_kept, ceil)
        return keep, mode, ceil

    keep, mode, ceil = jax.lax.cond(jnp.any(xtc), apply_xtc, lambda a: a, (keep, mode, ceil))
    return KeptSet(keep, mode, floor, ceil)
