"""Logits processors, in their fixed order: penalties, logit bias, masks, top-nσ.

`process_logits(logits [R, V], sampling, history, length, steps) -> [R, V]` is the one place
they run. Each group runs only when some row uses it (`lax.cond` on a per-row flag), and a row
with a control off gets its logits back unchanged, so an idle control costs one reduction.

1. repetition_penalty (CTRL / vLLM): every token seen in the prompt or the output has a
   positive logit divided by the penalty and a negative one multiplied by it.
2. presence / frequency (OpenAI): `l -= frequency * count + presence * (count > 0)` over
   generated tokens.
3. DRY (llama.cpp's): for each earlier end j of the last `n` tokens (`dry_penalty_last_n`, -1 =
   the whole `DRY_WINDOW`), L_j is the longest common suffix of `tokens[..j]` and the whole
   sequence, capped at the tokens since the last sequence breaker; the token that followed j
   would extend a repeat, and gets `multiplier * base^(L - allowed_length)` subtracted when
   `L >= allowed_length` (the largest L per token; the exponent capped at
   `88.72 / ln(base)` so it can't overflow; single-token breakers are never penalised).
4. LZ penalty (Ginart et al., arXiv 2504.20131): the LZ77 codelength `ΔC(a)` of each token as
   the next one, over a sliding window of the last `LZ_WINDOW` tokens with matches of at most
   `LZ_BUFFER` tokens (the paper's 512 / 32): `l -= α (log2 V - ΔC(a))`, where ΔC is log2 V
   for a token not in the window, `log2 δ` (δ its nearest distance) for one that starts or
   continues a shorter match, and `log2(1 - (d - l + 1) / (l d)) - 1` for the token that
   extends the longest current match (length l >= 2 at distance d).
5. logit_bias: `l[id] += bias`.
6. Masks (-inf): `banned`; `stop_ids` while fewer than `min_tokens` tokens are generated;
   bad words (vLLM's): a sequence's last token when the generated tokens end with the rest;
   then the step's grammar bitmask (constrained decoding), data like everything else.
7. top-nσ (llama.cpp's): keep `l >= max - n σ`, σ the population standard deviation of the
   finite logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from metrale_jax.engine.bitmask import unpack
from metrale_jax.engine.sampling_state import (
    DRY_WINDOW,
    MAX_BAD_WORD_TOKENS,
    SamplingState,
    TokenHistory,
)

LZ_WINDOW = 512
"""LZ penalty: the sliding window of the most recent tokens that matches are found in."""
LZ_BUFFER = 32
"""LZ penalty: the longest match (LZ77's look-ahead buffer)."""
_FLOAT_MAX_LOG = 88.7228391


def _when(flag: jax.Array, fn, logits: jax.Array) -> jax.Array:
    """`fn(logits)` when any row's `flag: [R]` is set, else `logits` untouched."""
    return jax.lax.cond(jnp.any(flag), fn, lambda x: x, logits)


def recent_tokens(tokens: jax.Array, length: jax.Array, window: int) -> tuple[jax.Array,
                                                                              jax.Array]:
    """The last `window` tokens of each row, oldest first: ([R, window] int32, valid [R,
    window] bool); positions before the start of the sequence are invalid (-1)."""
    window = min(window, tokens.shape[1])
    idx = length[:, None] - window + jnp.arange(window)[None, :]
    valid = idx >= 0
    got = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)
    return jnp.where(valid, got, -1), valid


def _bits_at(words: jax.Array, ids: jax.Array) -> jax.Array:
    """Bits of bitmasks `words: [R, W]` at token ids `ids: [R, N]` (-1: False)."""
    safe = jnp.maximum(ids, 0)
    w = jnp.take_along_axis(words, safe >> 5, axis=1)
    return (((w >> (safe & 31).astype(jnp.uint32)) & 1) == 1) & (ids >= 0)


def repetition(logits: jax.Array, s: SamplingState, h: TokenHistory) -> jax.Array:
    """CTRL's repetition penalty over prompt and output tokens."""
    seen = h.prompt_seen | (h.counts > 0)
    r = s.repetition_penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)


def presence_frequency(logits: jax.Array, s: SamplingState, h: TokenHistory) -> jax.Array:
    """OpenAI's presence and frequency penalties over output tokens."""
    counts = h.counts.astype(logits.dtype)
    return (logits - s.frequency_penalty[:, None] * counts
            - s.presence_penalty[:, None] * (counts > 0))


def dry_max_exponent(base: jax.Array) -> jax.Array:
    """llama.cpp's cap on DRY's exponent so `base ** e` stays finite (0 = no cap): [R] int32."""
    safe = jnp.where(base > 1.000001, base, 2.0)
    return jnp.where(base > 1.000001, jnp.floor(_FLOAT_MAX_LOG / jnp.log(safe)), 0).astype(
        jnp.int32)


def dry(logits: jax.Array, s: SamplingState, h: TokenHistory, length: jax.Array) -> jax.Array:
    """DRY: subtracts `multiplier * base^(L - allowed)` from each token that would extend a
    repeat of length L >= allowed (see the module docstring)."""
    R, V = logits.shape
    win, valid = recent_tokens(h.tokens, length, DRY_WINDOW)
    W = win.shape[1]
    j = jnp.arange(W)[None, :]
    last_n = jnp.where(s.dry_last_n < 0, W, jnp.minimum(s.dry_last_n, W))
    valid &= j >= W - last_n[:, None]
    win = jnp.where(valid, win, -1)
    n = jnp.sum(valid, axis=-1)
    allowed = s.dry_allowed_length
    on = (s.dry_multiplier > 0) & (s.dry_base >= 1) & (s.dry_last_n != 0) & (n > allowed)
    is_breaker = _bits_at(s.dry_breakers, win) & valid
    last_breaker = jnp.max(jnp.where(is_breaker, j, -1), axis=-1)
    rep_limit = jnp.minimum(W - 1 - last_breaker, n)
    on &= rep_limit >= allowed
    max_exp = dry_max_exponent(s.dry_base)
    # Beyond allowed + max_exp the penalty saturates: stop matching there.
    cap = jnp.where(max_exp > 0, jnp.minimum(rep_limit, allowed + max_exp + 1), rep_limit)
    cap = jnp.where(on, cap, 0)
    padded = jnp.concatenate([jnp.full((R, W), -1, win.dtype), win], axis=1)

    def cond(c):
        k, alive, _ = c
        return (k < W) & jnp.any(alive)

    def body(c):
        k, alive, match = c
        earlier = jax.lax.dynamic_slice_in_dim(padded, W - k, W, axis=1)  # win[j - k]
        pattern = jax.lax.dynamic_index_in_dim(win, W - 1 - k, axis=1)    # win[W-1-k]
        alive &= (earlier == pattern) & (earlier >= 0) & (k < cap)[:, None]
        return k + 1, alive, match + alive

    alive0 = (j < W - 1) & valid & on[:, None]
    _, _, match = jax.lax.while_loop(cond, body, (0, alive0, jnp.zeros((R, W), jnp.int32)))
    follows = jnp.concatenate([win[:, 1:], jnp.full((R, 1), -1, win.dtype)], axis=1)
    counts = (j < W - 1) & valid & (match >= allowed[:, None]) & on[:, None]
    target = jnp.where(counts & (follows >= 0), follows, V)
    rows = jnp.arange(R)[:, None]
    longest = jnp.full((R, V), -1, jnp.int32).at[rows, target].max(match, mode="drop")
    hit = (longest >= 0) & ~unpack(s.dry_breakers, V)
    e = longest - allowed[:, None]
    e = jnp.where((max_exp[:, None] > 0) & (e > max_exp[:, None]), max_exp[:, None], e)
    penalty = s.dry_multiplier[:, None] * jnp.power(s.dry_base[:, None], e.astype(logits.dtype))
    return jnp.where(hit, logits - penalty, logits)


def lz_penalty(logits: jax.Array, s: SamplingState, h: TokenHistory,
               length: jax.Array) -> jax.Array:
    """The LZ penalty: `logits - α (log2 V - ΔC)` with ΔC each token's LZ77 codelength as the
    next token (see the module docstring)."""
    R, V = logits.shape
    win, valid = recent_tokens(h.tokens, length, LZ_WINDOW)
    w = win.shape[1]
    j = jnp.arange(w)[None, :]
    LV = math.log2(V)
    padded = jnp.concatenate([jnp.full((R, w), -1, win.dtype), win], axis=1)
    alive = (j < w - 1) & valid
    match = jnp.zeros((R, w), jnp.int32)  # L(s): match ending at s with the newest suffix
    for k in range(min(LZ_BUFFER, w)):
        earlier = jax.lax.slice_in_dim(padded, w - k, 2 * w - k, axis=1)
        alive &= (earlier == win[:, w - 1 - k][:, None]) & (earlier >= 0)
        match += alive
    longest = jnp.max(match, axis=-1)                                   # l
    m = 1 + jnp.concatenate([jnp.zeros((R, 1), jnp.int32), match[:, :-1]], axis=1)
    m = jnp.where(valid, m, 0)                                          # copying win[j]
    rows = jnp.arange(R)[:, None]
    ids = jnp.where(valid, win, V)
    lam = jnp.zeros((R, V), jnp.int32).at[rows, ids].max(m, mode="drop")
    near = jnp.full((R, V), -1, jnp.int32).at[rows, ids].max(jnp.where(valid, j, -1),
                                                            mode="drop")
    extends = valid & (m == longest[:, None] + 1)
    ext = jnp.full((R, V), -1, jnp.int32).at[rows, ids].max(jnp.where(extends, j, -1),
                                                           mode="drop")
    f32 = logits.dtype
    delta = (w - near).astype(f32)
    copy_bits = jnp.minimum(jnp.log2(jnp.maximum(delta, 1.0)), LV)
    l_f = longest.astype(f32)[:, None]
    d_a = jnp.maximum((w - ext).astype(f32), 1.0)
    extend_bits = jnp.log2(jnp.maximum(1.0 - (d_a - l_f + 1.0) / (l_f * d_a), 1e-30)) - 1.0
    use_extend = (longest[:, None] >= 2) & (lam == longest[:, None] + 1) & (ext >= 0)
    bits = jnp.where(lam == 0, LV, jnp.where(use_extend, extend_bits, copy_bits))
    return logits - s.lz_penalty[:, None] * (LV - bits)


def bias(logits: jax.Array, s: SamplingState) -> jax.Array:
    """`logit_bias`: adds `bias_values` at `bias_ids` (id V = unused)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, s.bias_ids].add(s.bias_values, mode="drop")


def masks(logits: jax.Array, s: SamplingState, h: TokenHistory, length: jax.Array,
          steps: jax.Array) -> jax.Array:
    """-inf at banned tokens, stop tokens before min_tokens, and bad words' last tokens."""
    R, V = logits.shape
    ban = unpack(s.banned, V) | (unpack(s.stop_ids, V) & (steps < s.min_tokens)[:, None])
    n = MAX_BAD_WORD_TOKENS - 1
    tail, valid = recent_tokens(h.tokens, length, n)
    if tail.shape[1] < n:  # a history shorter than the longest prefix: pad on the left
        pad = n - tail.shape[1]
        tail = jnp.concatenate([jnp.full((R, pad), -1, tail.dtype), tail], axis=1)
        valid = jnp.concatenate([jnp.zeros((R, pad), bool), valid], axis=1)
    generated = valid & (jnp.arange(n)[None, :] >= n - steps[:, None])
    prefix = s.bad_words[:, :, :n]                                          # [R, NW, n]
    ok = (prefix < 0) | ((tail[:, None, :] == prefix) & generated[:, None, :])
    hit = jnp.all(ok, axis=-1) & (s.bad_word_lens > 0)
    last = jnp.where(hit, s.bad_words[:, :, n], V)
    ban = ban.at[jnp.arange(R)[:, None], last].set(True, mode="drop")
    return jnp.where(ban, -jnp.inf, logits)


def top_n_sigma(logits: jax.Array, s: SamplingState) -> jax.Array:
    """Keeps `logits >= max - n σ` in rows with `top_n_sigma = n > 0`; the rest -inf."""
    finite = logits > -jnp.inf
    count = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(finite, logits, 0.0), axis=-1, keepdims=True) / count
    var = jnp.sum(jnp.where(finite, (logits - mean) ** 2, 0.0), axis=-1, keepdims=True) / count
    floor = jnp.max(logits, axis=-1, keepdims=True) - s.top_n_sigma[:, None] * jnp.sqrt(var)
    return jnp.where((s.top_n_sigma[:, None] > 0) & (logits < floor), -jnp.inf, logits)


def masks_active(s: SamplingState, steps: jax.Array) -> jax.Array:
    """[R] bool: the row has a banned token, an unmet min_tokens or a bad word."""
    return (jnp.any(s.banned != 0, axis=-1) | (steps < s.min_tokens)
            | jnp.any(s.bad_word_lens > 0, axis=-1))


def allowed_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grammar masks: -inf where the bitmask `allowed: [R, ceil(V/32)]` uint32 has a 0 bit."""
    return jnp.where(unpack(allowed, logits.shape[1]), logits, -jnp.inf)


def process_logits(logits: jax.Array, s: SamplingState, h: TokenHistory, length: jax.Array,
                   steps: jax.Array, allowed: jax.Array | None = None) -> jax.Array:
    """All processors in order: `logits [R, V] float32 -> [R, V] float32`.

    h: the rows' `TokenHistory` with `length: [R]` valid positions; steps: [R] int32, the
    tokens generated so far; allowed: [R, ceil(V/32)] uint32 grammar bitmasks (all ones =
    unconstrained), applied with the other masks.
    """
    logits = _when(s.repetition_penalty != 1.0, lambda x: repetition(x, s, h), logits)
    logits = _when((s.presence_penalty != 0) | (s.frequency_penalty != 0),
                   lambda x: presence_frequency(x, s, h), logits)
    logits = _when((s.dry_multiplier > 0) & (s.dry_last_n != 0),
                   lambda x: dry(x, s, h, length), logits)
    logits = _when(s.lz_penalty != 0, lambda x: lz_penalty(x, s, h, length), logits)
    logits = _when(jnp.any(s.bias_ids < logits.shape[1], axis=-1), lambda x: bias(x, s), logits)
    logits = _when(masks_active(s, steps), lambda x: masks(x, s, h, length, steps), logits)
    if allowed is not None:
        logits = _when(jnp.any(allowed != jnp.uint32(0xFFFFFFFF), axis=-1),
                       lambda x: allowed_mask(x, allowed), logits)
    return _when(s.top_n_sigma > 0, lambda x: top_n_sigma(x, s), logits)
