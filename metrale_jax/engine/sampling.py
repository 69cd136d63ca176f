"""Per-slot sampling on the device: logits processors, truncation, and the draw.

Every setting is an array with one entry per slot (`SamplingState`), so no request compiles
anything. Row `b` is drawn with the key `fold_in(keys[b], steps[b])`, so a seeded request gives
the same tokens whatever else is in the batch.

The fixed order (also in `SamplingParams`' docstring):
1. `process_logits` (engine/logits_processors.py): penalties (repetition, presence/frequency,
   DRY, LZ), then logit_bias, then bans and min_tokens masks, then top-nσ.
2. temperature 0 = greedy (argmax of the processed logits); otherwise `x = logits / T`.
3. top_k -> top_p -> min_p -> typical_p -> XTC (engine/truncation.py), each renormalising over
   the tokens still kept.
4. The draw is Gumbel-max over the kept set with noise indexed by token id (a hash of the
   row's step key and the id), so the result does not depend on how the kept set was found:
   a row whose kept set lies within its top `CANDIDATES` draws over those only, a row whose
   kept set is a band of the vocabulary draws over the whole row, a wider kept set is looked
   for among the top `WIDE_CANDIDATES`, and only a row beyond those pays for a full sort
   (each computed only when some row needs it, with `lax.cond`).

Log-probabilities: "raw" (default) reports the model's own log-softmax; "processed" reports the
distribution actually sampled from (processed, tempered, truncated; greedy rows: the processed
logits at temperature 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from metrale_jax.engine.logits_processors import process_logits
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from metrale_jax.engine.truncation import BAND, EXACT, NEEDS_FULL, truncate

CANDIDATES = 256
"""How many of the largest logits the fast path looks at."""
WIDE_CANDIDATES = 2048
"""The second tier, for rows whose kept set reaches beyond CANDIDATES (a wide nucleus)."""
LOGPROBS_MODES = ("raw", "processed")
_XTC_STREAM = 0x58544321  # folded into a row's step key for its XTC draw


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """One sampled token per row: tokens [B] int32, logprobs [B] float32, top_ids [B, N] int32
    and top_logprobs [B, N] float32 (of the raw or the processed distribution)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def seed_to_key(seed: int) -> np.ndarray:
    """The raw `[2] uint32` key data for an integer seed (64 bits are kept)."""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


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


def step_keys(sampling: SamplingState, steps: jax.Array) -> jax.Array:
    """Each row's key data for this step, `fold_in(keys[b], steps[b])`: [R, 2] uint32."""
    return jax.vmap(lambda k, t: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(k), t)))(sampling.keys, steps)


def xtc_uniforms(row_keys: jax.Array) -> jax.Array:
    """Each row's XTC draw this step, from its own stream: [R] float32 in [0, 1)."""
    return jax.vmap(lambda k: jax.random.uniform(
        jax.random.fold_in(jax.random.wrap_key_data(k), _XTC_STREAM)))(row_keys)


@dataclasses.dataclass(frozen=True)
class _Drawn:
    """tokens [R] int32 and, for processed logprobs, the kept set over the vocabulary."""

    tokens: jax.Array
    keep: jax.Array | None


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (the first largest entry of each row `x: [..., V]` ->
    `[...]` int32) as two plain reductions, a max and a min over the indices holding it:
    XLA:CPU lowers argmax to one variadic (value, index) reduction that it does not
    vectorize, 4-5x slower over a large vocabulary (9 ms against ~2 ms for 16 rows of
    Gemma 3's 262,144 logits)."""
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == best, index, x.shape[-1] - 1), axis=-1)


def _full_sort(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    neg, ids = jax.lax.sort_key_val(-x, jnp.broadcast_to(
        jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape), dimension=-1)
    return -neg, ids


def _draw_sorted(vals: jax.Array, ids: jax.Array, keep: jax.Array,
                 row_keys: jax.Array) -> jax.Array:
    """Gumbel-max over kept sorted candidates `vals, ids, keep: [R, N]`: [R] int32 ids."""
    g = jax.vmap(_token_noise)(row_keys, ids)
    best = first_argmax(jnp.where(keep, vals + g, -jnp.inf))
    return jnp.take_along_axis(ids, best[:, None], axis=-1)[:, 0]


def _scatter(keep_sorted: jax.Array, ids: jax.Array, V: int) -> jax.Array:
    R = ids.shape[0]
    return jnp.zeros((R, V), jnp.bool_).at[jnp.arange(R)[:, None], ids].set(keep_sorted)


def _draw(x: jax.Array, sampling: SamplingState, row_keys: jax.Array, want_keep: bool) -> _Drawn:
    """Gumbel-max draw from tempered logits `x: [R, V]` over each row's kept set."""
    R, V = x.shape
    C = min(CANDIDATES, V)
    u = xtc_uniforms(row_keys)
    uses_candidates = ((sampling.top_k > 0) | (sampling.top_p < 1.0)
                       | (sampling.typical_p < 1.0) | (sampling.xtc_probability > 0))

    def with_candidates(_):
        vals, ids = jax.lax.top_k(x, C)
        ks = truncate(vals, x, sampling, u)
        return vals, ids.astype(jnp.int32), ks.keep, ks.mode, ks.floor, ks.ceil

    def without(_):  # every row is a min-p band
        floor = jnp.max(x, axis=-1) + jnp.log(sampling.min_p)
        return (jnp.zeros((R, C), x.dtype), jnp.zeros((R, C), jnp.int32),
                jnp.zeros((R, C), jnp.bool_), jnp.full((R,), BAND, jnp.int32), floor,
                jnp.full((R,), jnp.inf, x.dtype))

    vals, ids, keep_c, mode, floor, ceil = jax.lax.cond(
        jnp.any(uses_candidates), with_candidates, without, None)
    tok_c = _draw_sorted(vals, ids, keep_c, row_keys)
    all_ids = jnp.arange(V, dtype=jnp.int32)
    in_band = (x >= floor[:, None]) & (x <= ceil[:, None]) & (x > -jnp.inf)

    def band(_):
        g = jax.vmap(lambda k: _token_noise(k, all_ids))(row_keys)
        return first_argmax(jnp.where(in_band, x + g, -jnp.inf))

    zeros = lambda _: jnp.zeros((R,), jnp.int32)  # noqa: E731
    tok_b = jax.lax.cond(jnp.any(mode == BAND), band, zeros, None)
    no_keep = jnp.zeros((R, V if want_keep else 0), jnp.bool_)

    def sorted_all(_):
        s_f, ids_f = _full_sort(x)
        keep_f = truncate(s_f, None, sampling, u).keep
        return (_draw_sorted(s_f, ids_f, keep_f, row_keys),
                _scatter(keep_f, ids_f, V) if want_keep else no_keep)

    def wide(_):  # the wide candidates first; the full sort only for rows beyond them
        vals2, ids2 = jax.lax.top_k(x, min(WIDE_CANDIDATES, V))
        ids2 = ids2.astype(jnp.int32)
        ks2 = truncate(vals2, x, sampling, u)
        exact = ks2.mode == EXACT
        tok2 = _draw_sorted(vals2, ids2, ks2.keep, row_keys)
        kv2 = _scatter(ks2.keep, ids2, V) if want_keep else no_keep
        tok_s, kv_s = jax.lax.cond(jnp.any((mode == NEEDS_FULL) & ~exact), sorted_all,
                                   lambda _: (jnp.zeros((R,), jnp.int32), no_keep), None)
        return jnp.where(exact, tok2, tok_s), jnp.where(exact[:, None], kv2, kv_s)

    tok_f, keep_f = jax.lax.cond(jnp.any(mode == NEEDS_FULL), wide,
                                 lambda _: (jnp.zeros((R,), jnp.int32), no_keep), None)
    tokens = jnp.where(mode == EXACT, tok_c, jnp.where(mode == BAND, tok_b, tok_f))
    keep = None
    if want_keep:
        keep_e = _scatter(keep_c, ids, V)
        keep = jnp.where((mode == EXACT)[:, None], keep_e,
                         jnp.where((mode == BAND)[:, None], in_band, keep_f))
    return _Drawn(tokens.astype(jnp.int32), keep)


def kept_mask(x: jax.Array, sampling: SamplingState, steps: jax.Array | None = None) -> jax.Array:
    """The drawable tokens `[R, V] bool` of tempered logits `x: [R, V]` under each row's
    top-k, top-p, min-p, typical-p and XTC (XTC drawing with the rows' keys at `steps`)."""
    steps = jnp.zeros(x.shape[:1], jnp.int32) if steps is None else steps
    return _draw(x, sampling, step_keys(sampling, steps), want_keep=True).keep


def sample(logits: jax.Array, sampling: SamplingState, history: TokenHistory,
           length: jax.Array, steps: jax.Array, num_top: int,
           logprobs_mode: str = "raw", allowed: jax.Array | None = None) -> SampleResult:
    """Samples one token per row.

    logits: [R, V] float32 (the model's); history: the rows' `TokenHistory` with `length: [R]`
    valid positions (prompt + generated); steps: [R] int32, tokens generated so far (the step
    index folded into each row's key); allowed: [R, ceil(V/32)] uint32 grammar bitmasks or
    None. Returns the tokens, their log-probability and the top
    `num_top` tokens, of the raw or processed distribution (`logprobs_mode`).
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
    processed_mode = logprobs_mode == "processed"
    R, V = logits.shape
    proc = process_logits(logits, sampling, history, length, steps, allowed)
    greedy = first_argmax(proc)
    t = sampling.temperature
    hot = t > 0
    row_keys = step_keys(sampling, steps)
    x = proc / jnp.where(hot, t, 1.0)[:, None]

    def draw(_):
        d = _draw(x, sampling, row_keys, processed_mode)
        keep = d.keep if processed_mode else jnp.zeros((R, 0), jnp.bool_)
        return jnp.where(hot, d.tokens, greedy), keep

    def all_greedy(_):
        return greedy, jnp.ones((R, V if processed_mode else 0), jnp.bool_)

    tokens, keep = jax.lax.cond(jnp.any(hot), draw, all_greedy, None)
    if processed_mode:  # greedy rows: the processed logits, untruncated
        dist = jax.nn.log_softmax(jnp.where(hot[:, None] & ~keep, -jnp.inf, x), axis=-1)
    else:
        dist = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(dist, num_top)
    logprobs = jnp.take_along_axis(dist, tokens[:, None], axis=-1)[:, 0]
    return SampleResult(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)
