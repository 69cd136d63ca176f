"""NumPy float64 reference implementations of every sampling control of issue #5.

They are written from the definitions (llama.cpp `src/llama-sampling.cpp`, vLLM, OpenAI, the LZ
penalty of Ginart et al., arXiv 2504.20131) and kept deliberately plain: loops over one row,
no vectorisation tricks. They are what the device sampler is checked against on random logits
and random histories (|Δ| ≤ 1e-5 on processed logits, identical kept sets).

Conventions for every function:
- One row. `logits` / `x` is a float array [V]; inputs are never modified, a float64 copy is
  returned.
- `history` is the 1-D int array of the tokens so far: the prompt's tokens followed by the
  generated ones. `generated` is `history[n_prompt:]`.
- A kept-set stage takes the (already tempered) logits `x` and a boolean `kept` [V], and returns
  a new `kept`. Probabilities are a softmax over the *currently kept* tokens (renormalised).
  Stages only shrink the set; they never change `x`.
- Sorting ties: descending logit (or ascending typical score), then ascending token id, i.e. a
  stable sort over ids.

`process` chains everything in the fixed order of the issue:
penalties (repetition → presence/frequency → DRY → LZ) → logit_bias → bans / bad_words /
min_tokens masks → top-nσ → temperature → top_k → top_p → min_p → typical_p → XTC.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULTS",
    "bad_words",
    "bans",
    "dry",
    "logit_bias",
    "lz_codelength_delta",
    "lz_penalty",
    "min_p",
    "min_tokens",
    "presence_frequency",
    "process",
    "repetition_penalty",
    "softmax_over",
    "temperature",
    "top_k",
    "top_n_sigma",
    "top_p",
    "typical_p",
    "xtc",
]

NEG_INF = -np.inf
# llama.cpp: `const float FLOAT_MAX_LOG = 88.7228391f;` (≈ ln FLT_MAX), the DRY exponent cap.
FLOAT_MAX_LOG = 88.7228391


def _row(logits) -> np.ndarray:
    out = np.array(logits, dtype=np.float64, copy=True)
    if out.ndim != 1:
        raise ValueError(f"expected one row [V], got shape {out.shape}")
    return out


def _ids(tokens) -> np.ndarray:
    arr = np.asarray(tokens if tokens is not None else [], dtype=np.int64).reshape(-1)
    return arr


def _mask(kept, v: int) -> np.ndarray:
    kept = np.asarray(kept, dtype=bool)
    if kept.shape != (v,):
        raise ValueError(f"kept mask has shape {kept.shape}, expected ({v},)")
    return kept.copy()


def softmax_over(x, kept) -> np.ndarray:
    """Probabilities [V] of a softmax over the kept entries only (0 elsewhere), float64."""
    x = np.asarray(x, dtype=np.float64)
    kept = np.asarray(kept, dtype=bool)
    p = np.zeros(len(x))
    if not kept.any():
        return p
    m = x[kept].max()
    e = np.exp(x[kept] - m)
    p[kept] = e / e.sum()
    return p


def _order_desc(x, kept) -> np.ndarray:
    """Kept token ids by descending logit, ties by ascending id."""
    ids = np.flatnonzero(kept)
    return ids[np.argsort(-np.asarray(x, dtype=np.float64)[ids], kind="stable")]


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------


def repetition_penalty(logits, history, penalty: float) -> np.ndarray:
    """vLLM/CTRL repetition penalty over prompt + generated tokens.

    For every token id that appears anywhere in `history`: a positive logit is divided by
    `penalty`, a zero or negative one multiplied (vLLM: `where(l > 0, l / r, l * r)`).
    `penalty == 1` is off.
    """
    out = _row(logits)
    if penalty == 1.0:
        return out
    seen = np.unique(_ids(history))
    seen = seen[(seen >= 0) & (seen < len(out))]
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def presence_frequency(logits, generated, presence: float, frequency: float) -> np.ndarray:
    """OpenAI presence/frequency penalties over the generated tokens only.

    `logits[v] -= frequency * count_v + presence * (count_v > 0)`.
    """
    out = _row(logits)
    gen = _ids(generated)
    counts = np.bincount(gen[(gen >= 0) & (gen < len(out))], minlength=len(out))
    counts = counts[: len(out)].astype(np.float64)
    out -= frequency * counts + presence * (counts > 0)
    return out


def dry(logits, history, multiplier: float, base: float, allowed_length: int,
        penalty_last_n: int, breaker_ids: Iterable[int] = ()) -> np.ndarray:
    """DRY ("don't repeat yourself"), llama.cpp `llama_sampler_dry_apply` semantics.

    Implemented exactly as llama.cpp does, step by step:

    1. Off when `multiplier == 0`, `base < 1` or `penalty_last_n == 0`.
    2. The context `win` is the last `n` tokens of `history`: `n = len(history)` if
       `penalty_last_n == -1` (llama.cpp: the whole context), else
       `min(penalty_last_n, len(history))`. Nothing happens if `n <= allowed_length`.
    3. `rep_limit`, the longest match allowed: scanning back from the newest token
       (i = 0, 1, ...), the first token that is a breaker sets `rep_limit = i`, the number of
       tokens after the last breaker; with no breaker `rep_limit = n`. Nothing happens if
       `rep_limit < allowed_length`.
    4. For each end position j = 0 .. n-2 of `win`: `rc[j] = min(L_j, rep_limit)`, where L_j is
       the length of the longest common suffix of `win[:j+1]` and `win`: the largest L with
       `win[j-k] == win[n-1-k]` for k < L, `j-k >= 0`. Matches may overlap. (llama.cpp gets the
       same numbers with a reverse Z-algorithm.) The cap at `rep_limit` stops a match at a
       breaker: the last `rep_limit` tokens hold no breaker, so an equal earlier run cannot
       hold one either.
    5. For every j with `rc[j] >= allowed_length`, the token that followed the earlier
       occurrence, `t = win[j+1]`, would extend a repeat: `maxrep[t] = max(maxrep[t], rc[j])`.
    6. Exponent cap against overflow: `max_exponent = int(88.7228391 / ln(base))` if
       `base > 1.000001`, else 0. For each t in maxrep that is not a breaker,
       `e = maxrep[t] - allowed_length`, lowered to `max_exponent` if `max_exponent > 0` and
       `e > max_exponent`; then `logits[t] -= multiplier * base**e`.

    Breakers: llama.cpp takes breaker *strings* and turns them into token sequences
    (`get_overlapping_token_sequences`). A token whose text contains the string is a
    single-token breaker. A token whose text ends with a proper prefix of the string becomes
    the head of a multi-token breaker: head + tokenization of the rest, at most 20 tokens.
    Here `breaker_ids` is a set of token ids, and only the **single-token** case is modelled.
    A breaker id in the context cuts matches (step 3), and a breaker id is never penalised
    itself (step 6). llama.cpp's multi-token sequences are not modelled: in llama.cpp such a
    sequence, found in order in the context, sets `rep_limit = i - len(tail)`, and its head
    token can still be penalised. With the default breakers ("\\n", ":", "\\"", "*"), all one
    character long, llama.cpp produces single-token breakers only, so this is exact for them.
    The arithmetic is float64. llama.cpp computes `pow` and the exponent cap in float32.
    """
    out = _row(logits)
    if multiplier == 0.0 or base < 1.0 or penalty_last_n == 0:
        return out
    if penalty_last_n < -1:
        raise ValueError("dry_penalty_last_n must be -1 (whole context), 0 (off) or positive")
    hist = _ids(history)
    n = len(hist) if penalty_last_n == -1 else min(penalty_last_n, len(hist))
    if n <= allowed_length:
        return out
    win = hist[len(hist) - n:]
    breakers = {int(b) for b in breaker_ids}

    rep_limit = n
    for i in range(n):
        if int(win[n - 1 - i]) in breakers:
            rep_limit = i
            break
    if rep_limit < allowed_length:
        return out

    maxrep: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while j - length >= 0 and win[j - length] == win[n - 1 - length]:
            length += 1
        rc = min(length, rep_limit)
        if rc >= allowed_length:
            t = int(win[j + 1])
            maxrep[t] = max(maxrep.get(t, 0), rc)

    max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    for t, rep in maxrep.items():
        if t in breakers or not 0 <= t < len(out):
            continue
        e = rep - allowed_length
        if max_exponent > 0 and e > max_exponent:
            e = max_exponent
        out[t] -= multiplier * base ** e
    return out


def lz_codelength_delta(history, vocab_size: int, window: int = 512,
                        buffer: int = 32) -> np.ndarray:
    """ΔC(a) [V] in bits: the LZ77 codelength of appending token a to `history`.

    The closed form of the LZ penalty paper (Ginart et al., arXiv 2504.20131, their eq. 14, as
    quoted by a reimplementation; the authors' demo code has the same three cases):

        ΔC(a) = log2 V                        if λ(a) = 0      (a literal)
                log2 δ(a)                     if λ(a) = 1      (a new length-1 match)
                log2(1 - (d-l+1)/(l·d)) - 1   if λ(a) = l + 1  (a extends the longest match)

    Precisely, with h = history, n = len(h), and the candidate at position n:

    - The sliding window is the last `window` tokens, positions lo = max(0, n - window) .. n-1.
      It holds the match sources and the context. `buffer` (LZ77's lookahead size) caps the
      length of a match of the context.
    - For each earlier end s in [lo, n-2]: L(s) = the largest L <= buffer with
      `h[s-k] == h[n-1-k]` for k < L and `s-k >= lo`. The current longest match is
      l = max_s L(s) (0 if there is none).
    - Copying source j in [lo, n-1] (the token h[j], at distance n - j) makes a match of
      length m_j = 1 + L(j-1) (just 1 if j = lo). For token a: λ(a) = max m_j over j with
      h[j] = a (0 if a is not in the window), and δ(a) = n - max{j : h[j] = a}, its nearest
      occurrence.
    - ΔC(a) = log2 V if λ(a) = 0. If l >= 2 and λ(a) = l + 1, then
      ΔC(a) = log2(1 - (d-l+1)/(l·d)) - 1 with d = n - max{j : h[j] = a, m_j = l + 1}, the
      distance of the longest match that a extends (nearest if several). Otherwise
      ΔC(a) = min(log2 δ(a), log2 V). That covers λ = 1; λ in 2..l, where eq. 14 says nothing
      (my choice); and l = 1, where eq. 14's third case would be log2 0 and the authors' code
      falls back to log2 δ.
    """
    if window < 1 or buffer < 1:
        raise ValueError("lz window and buffer must be >= 1")
    lv = math.log2(vocab_size)
    delta = np.full(vocab_size, lv)
    h = _ids(history)
    n = len(h)
    if n == 0:
        return delta
    lo = max(0, n - window)

    L: dict[int, int] = {}
    for s in range(lo, n - 1):
        k = 0
        while k < buffer and s - k >= lo and h[s - k] == h[n - 1 - k]:
            k += 1
        L[s] = k
    l = max(L.values(), default=0)

    lam: dict[int, int] = {}
    nearest: dict[int, int] = {}
    ext: dict[int, int] = {}
    for j in range(lo, n):
        a = int(h[j])
        m = 1 + (L[j - 1] if j - 1 >= lo else 0)
        lam[a] = max(lam.get(a, 0), m)
        nearest[a] = j                                  # j ascends: the last write is nearest
        if m == l + 1:
            ext[a] = j

    for a, lam_a in lam.items():
        if not 0 <= a < vocab_size:
            continue
        if l >= 2 and lam_a == l + 1:
            d = n - ext[a]
            delta[a] = math.log2(1.0 - (d - l + 1) / (l * d)) - 1.0
        else:
            delta[a] = min(math.log2(n - nearest[a]), lv)
    return delta


def lz_penalty(logits, history, strength: float, window: int = 512,
               buffer: int = 32) -> np.ndarray:
    """LZ penalty (Ginart et al., arXiv 2504.20131): `logits - strength * (log2 V - ΔC(a))`.

    ΔC is `lz_codelength_delta` (read its docstring for the exact definition). The paper samples
    from `p(a) · 2^(α ΔC(a))`, the residual once the compressible information is gone. The
    penalty form used here differs from `logits + α ΔC` only by the constant `α log2 V`. So it
    gives the same distribution, and it leaves tokens absent from the window unchanged
    (penalty 0). Defaults: window 512, buffer 32 (the sizes used with the paper's 128k
    vocabularies and in the authors' code). `strength == 0` is off. History is whatever the
    caller passes; `process` passes prompt + generated.
    """
    out = _row(logits)
    if strength == 0.0 or len(_ids(history)) == 0:
        return out
    delta = lz_codelength_delta(history, len(out), window, buffer)
    out -= strength * (math.log2(len(out)) - delta)
    return out


# --------------------------------------------------------------------------------------------
# Bias and masks
# --------------------------------------------------------------------------------------------


def logit_bias(logits, bias: Mapping[int, float]) -> np.ndarray:
    """OpenAI logit_bias: `logits[id] += bias[id]` (ids must be in the vocabulary)."""
    out = _row(logits)
    for tok, b in (bias or {}).items():
        tok = int(tok)
        if not 0 <= tok < len(out):
            raise ValueError(f"logit_bias token id {tok} outside the vocabulary")
        out[tok] += float(b)
    return out


def bans(logits, banned_ids: Iterable[int]) -> np.ndarray:
    """`logits[id] = -inf` for every banned id."""
    out = _row(logits)
    ids = _ids(list(banned_ids))
    out[ids[(ids >= 0) & (ids < len(out))]] = NEG_INF
    return out


def bad_words(logits, generated, bad_word_seqs: Iterable[Sequence[int]]) -> np.ndarray:
    """vLLM v1 `_apply_bad_words_single_batch` over the generated tokens.

    For each banned token sequence w: skip it if `len(w) > len(generated) + 1`. A single-token
    w always bans w[0]. A longer w bans its last token when the generated tokens end with
    w[:-1].
    """
    out = _row(logits)
    gen = [int(t) for t in _ids(generated)]
    for seq in bad_word_seqs:
        seq = [int(t) for t in seq]
        if not seq or len(seq) > len(gen) + 1:
            continue
        prefix = seq[:-1]
        actual = gen[len(gen) - len(prefix):] if prefix else []
        if actual == prefix and 0 <= seq[-1] < len(out):
            out[seq[-1]] = NEG_INF
    return out


def min_tokens(logits, n_generated: int, min_tokens: int, stop_ids: Iterable[int]) -> np.ndarray:
    """Mask eos/stop ids (-inf) while fewer than `min_tokens` tokens have been generated."""
    out = _row(logits)
    if n_generated < min_tokens:
        ids = _ids(list(stop_ids))
        out[ids[(ids >= 0) & (ids < len(out))]] = NEG_INF
    return out


def top_n_sigma(logits, n: float) -> np.ndarray:
    """llama.cpp top-nσ: keep `logit >= max - n·σ` and set the rest to -inf.

    max, mean and σ (the population std, ddof 0) are taken over the logits that are not -inf.
    `n <= 0` or V <= 1 is off.
    """
    out = _row(logits)
    if n <= 0 or len(out) <= 1:
        return out
    finite = out != NEG_INF
    if not finite.any():
        return out
    vals = out[finite]
    mx = vals.max()
    sigma = math.sqrt(np.mean((vals - vals.mean()) ** 2))
    out[out < mx - n * sigma] = NEG_INF
    return out


def temperature(logits, t: float) -> np.ndarray:
    """`logits / t` (t > 0). Greedy (t == 0) is handled by `process`."""
    if t <= 0:
        raise ValueError("temperature must be > 0 here; t == 0 (greedy) is handled by process")
    return _row(logits) / t


# --------------------------------------------------------------------------------------------
# Kept-set stages (renormalised over the current kept set)
# --------------------------------------------------------------------------------------------


def top_k(x, kept, k: int) -> np.ndarray:
    """Keep the k largest kept logits (ties: lower id first). `k <= 0` is off."""
    x = _row(x)
    kept = _mask(kept, len(x))
    if k <= 0 or k >= kept.sum():
        return kept
    new = np.zeros_like(kept)
    new[_order_desc(x, kept)[:k]] = True
    return new


def top_p(x, kept, p: float) -> np.ndarray:
    """Nucleus: in descending order, keep each token whose preceding mass is `< p`.

    That is the smallest prefix whose mass reaches p (llama.cpp stops at the first
    `cum >= p`). The most probable token is always kept. `p >= 1` is off.
    """
    x = _row(x)
    kept = _mask(kept, len(x))
    if p >= 1.0 or not kept.any():
        return kept
    order = _order_desc(x, kept)
    probs = softmax_over(x, kept)[order]
    before = np.cumsum(probs) - probs
    keep = before < p
    keep[0] = True
    new = np.zeros_like(kept)
    new[order[keep]] = True
    return new


def min_p(x, kept, p: float) -> np.ndarray:
    """Keep `prob_i >= p * prob_max` over the kept set, i.e. `exp(x_i - x_max) >= p`.

    The ratio does not depend on normalisation. `p <= 0` is off.
    """
    x = _row(x)
    kept = _mask(kept, len(x))
    if p <= 0.0 or not kept.any():
        return kept
    mx = x[kept].max()
    ratio = np.zeros(len(x))
    ratio[kept] = np.exp(x[kept] - mx)
    return kept & (ratio >= p)


def typical_p(x, kept, p: float, min_keep: int = 1) -> np.ndarray:
    """Locally typical sampling, llama.cpp `llama_sampler_typical_apply` (HF's rule).

    Over the kept set: probs, entropy `H = -Σ p ln p`, score `|-ln p_i - H|`. Sort by
    ascending score (ties: lower id). Accumulate probabilities and stop at the first position i
    where `cum > p` (strict, as llama.cpp) and `i >= min_keep - 1`. Keep positions 0..i. If the
    sum never exceeds p (rounding), keep all. `p >= 1` is off. A probability that underflows to
    0 counts 0 in H and gets score +inf.
    """
    x = _row(x)
    kept = _mask(kept, len(x))
    if p >= 1.0 or not kept.any():
        return kept
    ids = np.flatnonzero(kept)
    probs = softmax_over(x, kept)[ids]
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)
        ent = -np.sum(np.where(probs > 0, probs * logp, 0.0))
        score = np.where(probs > 0, np.abs(-logp - ent), np.inf)
    order = np.argsort(score, kind="stable")
    cum = 0.0
    last = len(order)
    for i, o in enumerate(order):
        cum += probs[o]
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    new = np.zeros_like(kept)
    new[ids[order[:last]]] = True
    return new


def xtc(x, kept, threshold: float, probability: float, u: float,
        min_keep: int = 1) -> np.ndarray:
    """XTC (exclude top choices), llama.cpp `llama_sample_xtc_apply`.

    `u` is the slot's uniform draw. No-op when `probability <= 0`, `threshold > 0.5`, fewer
    than 2 tokens are kept, or `u > probability`. Otherwise sort the kept tokens by descending
    probability (ties: lower id). pos_last is the last position from the top with
    `p >= threshold` (inclusive); the scan stops at the first p below it, and pos_last = 0 if
    even the top is below. If `pos_last > 0` (at least two tokens at or above the threshold) and
    `|kept| - pos_last >= min_keep`, drop the first pos_last tokens. That removes every token
    at or above the threshold except the least probable of them. Tokens below the threshold
    stay.
    """
    x = _row(x)
    kept = _mask(kept, len(x))
    n_kept = int(kept.sum())
    if probability <= 0.0 or threshold > 0.5 or n_kept < 2 or u > probability:
        return kept
    order = _order_desc(x, kept)
    probs = softmax_over(x, kept)[order]
    pos_last = 0
    for i in range(n_kept):
        if probs[i] >= threshold:
            pos_last = i
        else:
            break
    if n_kept - pos_last >= min_keep and pos_last > 0:
        new = kept.copy()
        new[order[:pos_last]] = False
        return new
    return kept


# --------------------------------------------------------------------------------------------
# The whole chain
# --------------------------------------------------------------------------------------------

DEFAULTS: dict[str, object] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_breaker_ids": (),
    "lz_penalty": 0.0,
    "lz_window": 512,
    "lz_buffer": 32,
    "logit_bias": {},
    "banned_ids": (),
    "bad_words": (),
    "min_tokens": 0,
    "stop_ids": (),
    "top_n_sigma": 0.0,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "xtc_threshold": 0.1,
    "xtc_probability": 0.0,
    "xtc_u": None,
}


def process(logits, history, n_prompt: int, params: Mapping[str, object]):
    """The whole chain in the issue's fixed order. Returns `(processed_logits, kept_mask)`.

    Order: repetition → presence/frequency (generated only) → DRY → LZ (prompt + generated) →
    logit_bias → bans, bad_words (generated), min_tokens (stop_ids: eos and stop_token_ids, as
    the caller decides) → top-nσ → temperature → top_k → top_p → min_p → typical_p → XTC.

    `processed_logits` is the tempered row, holding the -inf set by the masks and top-nσ. It is
    not masked by `kept_mask`. The kept set starts as the finite entries. With
    `temperature == 0` (greedy) the result is the row from before temperature, and a kept mask
    holding only its argmax (the first index among ties). The kept-set stages do not run.
    Keys of `params` are those of `DEFAULTS`; missing ones take the default (everything off).
    `xtc_u` must be given when `xtc_probability > 0`.
    """
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise KeyError(f"unknown sampling params: {sorted(unknown)}")
    prm = {**DEFAULTS, **params}
    hist = _ids(history)
    if not 0 <= n_prompt <= len(hist):
        raise ValueError("n_prompt must be within the history")
    generated = hist[n_prompt:]

    out = repetition_penalty(logits, hist, float(prm["repetition_penalty"]))
    out = presence_frequency(out, generated, float(prm["presence_penalty"]),
                             float(prm["frequency_penalty"]))
    out = dry(out, hist, float(prm["dry_multiplier"]), float(prm["dry_base"]),
              int(prm["dry_allowed_length"]), int(prm["dry_penalty_last_n"]),
              prm["dry_breaker_ids"])
    out = lz_penalty(out, hist, float(prm["lz_penalty"]), int(prm["lz_window"]),
                     int(prm["lz_buffer"]))
    out = logit_bias(out, prm["logit_bias"])
    out = bans(out, prm["banned_ids"])
    out = bad_words(out, generated, prm["bad_words"])
    out = min_tokens(out, len(generated), int(prm["min_tokens"]), prm["stop_ids"])
    out = top_n_sigma(out, float(prm["top_n_sigma"]))

    t = float(prm["temperature"])
    if t < 0:
        raise ValueError("temperature must be >= 0")
    if t == 0.0:
        kept = np.zeros(len(out), dtype=bool)
        kept[int(np.argmax(out))] = True
        return out, kept

    x = temperature(out, t)
    kept = np.isfinite(x)
    kept = top_k(x, kept, int(prm["top_k"]))
    kept = top_p(x, kept, float(prm["top_p"]))
    kept = min_p(x, kept, float(prm["min_p"]))
    kept = typical_p(x, kept, float(prm["typical_p"]))
    xp = float(prm["xtc_probability"])
    if xp > 0.0:
        if prm["xtc_u"] is None:
            raise ValueError("xtc_u (the uniform draw) is required when xtc_probability > 0")
        kept = xtc(x, kept, float(prm["xtc_threshold"]), xp, float(prm["xtc_u"]))
    return x, kept
