"""Self-tests of the NumPy sampling references (`sampling_reference.py`).

Every expected value is worked out by hand from the definition in the reference's docstring
(and /tmp/notes/sampling_spec.md). Two property tests also check the plain loops against
independent formulations:
- DRY against a line-by-line port of llama.cpp's reverse Z-algorithm;
- the LZ penalty against the vectorised [W]-window recipe of the spec note.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine import sampling_reference as ref

NEG = -np.inf


def logp(*probs):
    """Logits whose softmax is exactly `probs` (up to rounding)."""
    return np.log(np.array(probs, dtype=np.float64))


def ids(mask):
    return np.flatnonzero(mask).tolist()


# --------------------------------------------------------------------------------------------
# Repetition, presence, frequency
# --------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    out = ref.repetition_penalty([2.0, -2.0, 3.0, 0.5, 0.0], [0, 1, 1, 4], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 3.0, 0.5, 0.0])
    np.testing.assert_array_equal(ref.repetition_penalty([2.0, -2.0], [0, 1], 1.0), [2.0, -2.0])


def test_presence_frequency_counts_generated_only():
    out = ref.presence_frequency(np.zeros(4), [1, 1, 3], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(out, [0.0, -1.0, 0.0, -0.75])
    # Through process: the prompt's tokens (2, 2) do not count.
    x, _ = ref.process(np.zeros(4), [2, 2, 1, 1, 3], 2,
                       {"presence_penalty": 0.5, "frequency_penalty": 0.25})
    np.testing.assert_allclose(x, [0.0, -1.0, 0.0, -0.75])


def test_repetition_penalty_in_process_covers_the_prompt():
    x, _ = ref.process([2.0, 2.0, 2.0], [0, 1], 1, {"repetition_penalty": 2.0})
    np.testing.assert_allclose(x, [1.0, 1.0, 2.0])


# --------------------------------------------------------------------------------------------
# DRY
# --------------------------------------------------------------------------------------------

A, B, C, D, Y, P = 0, 1, 2, 3, 4, 5
M, BASE = 0.8, 1.75


def dry_delta(history, v=6, allowed=2, last_n=-1, breakers=(), mult=M, base=BASE):
    return ref.dry(np.zeros(v), history, mult, base, allowed, last_n, breakers)


def test_dry_abcab_penalises_c_by_multiplier():
    # "a b c a b": the suffix "a b" (length 2) occurred before, followed by "c".
    want = np.zeros(6)
    want[C] = -M * BASE ** (2 - 2)
    np.testing.assert_allclose(dry_delta([A, B, C, A, B]), want)


def test_dry_longer_match_raises_exponent():
    # "a b c d a b c": match "a b c" (3) → "d" gets m·β^(3-2).
    want = np.zeros(6)
    want[D] = -M * BASE ** 1
    np.testing.assert_allclose(dry_delta([A, B, C, D, A, B, C]), want)


def test_dry_llamacpp_source_example():
    # From the comment in llama.cpp: "a b c c b c y a b c", repeat counts 0 0 3 1 0 2 0 0 0 0.
    # "c" (after the first "a b c") extends a repeat of 3, "y" one of 2, "b" only 1 (< 2).
    want = np.zeros(6)
    want[C] = -M * BASE ** 1
    want[Y] = -M * BASE ** 0
    np.testing.assert_allclose(dry_delta([A, B, C, C, B, C, Y, A, B, C]), want)


def test_dry_overlapping_run():
    # "a a a a": suffix matches of length 1, 2, 3 end at j = 0, 1, 2; "a" follows the 2 and the 3.
    want = np.zeros(6)
    want[A] = -M * BASE ** (3 - 2)
    np.testing.assert_allclose(dry_delta([A, A, A, A]), want)


def test_dry_breaker_caps_the_match_length():
    hist = [P, A, B, C, D, P, A, B, C]
    # No breaker: "p a b c" (4) repeats, "d" gets β^(4-2).
    want = np.zeros(6)
    want[D] = -M * BASE ** 2
    np.testing.assert_allclose(dry_delta(hist), want)
    # "p" a breaker: the match may not reach over it, rep_limit = 3 → β^(3-2).
    want[D] = -M * BASE ** 1
    np.testing.assert_allclose(dry_delta(hist, breakers={P}), want)


def test_dry_never_penalises_a_breaker_and_stops_when_too_short():
    # "a b c a b" with "c" a breaker: "c" would be penalised but is itself a breaker.
    np.testing.assert_array_equal(dry_delta([A, B, C, A, B], breakers={C}), np.zeros(6))
    # Newest token is a breaker: rep_limit = 0 < allowed_length → nothing.
    np.testing.assert_array_equal(dry_delta([A, B, A, B, P], breakers={P}), np.zeros(6))


def test_dry_penalty_last_n_window():
    hist = [A, B, C, A, B]
    # Last 4 tokens "b c a b": only a repeat of 1 (< 2) → nothing.
    np.testing.assert_array_equal(dry_delta(hist, last_n=4), np.zeros(6))
    want = np.zeros(6)
    want[C] = -M
    np.testing.assert_allclose(dry_delta(hist, last_n=5), want)
    np.testing.assert_allclose(dry_delta(hist, last_n=50), want)
    np.testing.assert_array_equal(dry_delta(hist, last_n=0), np.zeros(6))   # 0 = off
    # n <= allowed_length → nothing.
    np.testing.assert_array_equal(dry_delta([A, A], allowed=2), np.zeros(6))


def test_dry_off_switches():
    hist = [A, B, C, A, B]
    np.testing.assert_array_equal(dry_delta(hist, mult=0.0), np.zeros(6))
    np.testing.assert_array_equal(dry_delta(hist, base=0.9), np.zeros(6))
    # base == 1: no exponent cap, penalty m·1^e = m.
    want = np.zeros(6)
    want[D] = -M
    np.testing.assert_allclose(dry_delta([A, B, C, D, A, B, C], base=1.0), want)


def test_dry_exponent_cap():
    # base 1000: max_exponent = int(88.7228391 / ln 1000) = int(12.84) = 12.
    assert int(88.7228391 / math.log(1000.0)) == 12
    v = 21
    hist = list(range(20)) + list(range(19))           # match of 19 → token 19, e = 17 → 12
    out = ref.dry(np.zeros(v), hist, 0.5, 1000.0, 2, -1, ())
    want = np.zeros(v)
    want[19] = -0.5 * 1000.0 ** 12
    np.testing.assert_allclose(out, want)
    assert np.isfinite(out).all()


def dry_llamacpp_port(logits, history, mult, base, allowed, last_n, breakers):
    """A line-by-line Python port of llama.cpp's DRY apply (single-token breakers)."""
    out = np.array(logits, dtype=np.float64)
    if mult == 0.0 or base < 1.0 or last_n == 0:
        return out
    hist = list(history)
    eff = len(hist) if last_n == -1 else last_n
    n = min(len(hist), eff)
    if n <= allowed:
        return out

    def rat(i):
        return hist[len(hist) - 1 - i]

    rep_limit = n
    for i in range(n):
        if rat(i) in breakers:
            rep_limit = i
            break
    if rep_limit < allowed:
        return out
    rc = [0] * n
    last, rt, lt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            rc[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if rc[last - p] < right_part_len:
                rc[last - k] = min(rc[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                rc[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    maxrep = {}
    for i in range(n - 1):
        if rc[i] >= allowed:
            tok = rat(n - 2 - i)
            maxrep[tok] = max(maxrep.get(tok, 0), rc[i])
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for tok, rep in maxrep.items():
        if tok in breakers:
            continue
        e = rep - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        out[tok] -= mult * base ** e
    return out


@settings(max_examples=300, deadline=None)
@given(hist=st.lists(st.integers(0, 3), max_size=40), allowed=st.integers(0, 4),
       last_n=st.sampled_from([-1, 1, 3, 7, 16, 100]),
       breakers=st.sets(st.integers(0, 3), max_size=2),
       base=st.sampled_from([1.0, 1.3, 1.75, 3.0]))
def test_dry_matches_llamacpp_z_algorithm(hist, allowed, last_n, breakers, base):
    logits = np.linspace(-1.0, 1.0, 4)
    got = ref.dry(logits, hist, 0.8, base, allowed, last_n, breakers)
    want = dry_llamacpp_port(logits, hist, 0.8, base, allowed, last_n, breakers)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# LZ penalty
# --------------------------------------------------------------------------------------------


def lz_pen(history, v=8, window=512, buffer=32, strength=1.0):
    """-(penalty) per token: processed logits of a zero row."""
    return ref.lz_penalty(np.zeros(v), history, strength, window, buffer)


def test_lz_extension_singletons_and_literals():
    # h = 1 2 3 1 2, V = 8 (log2 V = 3). The suffix "1 2" (l = 2) occurred ending at s = 1,
    # d = 3, followed by 3 → token 3 extends it: ΔC = log2(1 - (3-2+1)/(2·3)) - 1.
    # Token 1: nearest at distance 2 → ΔC = 1. Token 2: distance 1 → ΔC = 0. Others: literal.
    want = np.zeros(8)
    want[3] = -(3.0 - (math.log2(1 - 2 / 6) - 1))
    want[1] = -(3.0 - 1.0)
    want[2] = -(3.0 - 0.0)
    np.testing.assert_allclose(lz_pen([1, 2, 3, 1, 2]), want, atol=1e-12)
    # Strength scales the penalty linearly; 0 is off.
    np.testing.assert_allclose(lz_pen([1, 2, 3, 1, 2], strength=0.15), 0.15 * want, atol=1e-12)
    np.testing.assert_array_equal(lz_pen([1, 2, 3, 1, 2], strength=0.0), np.zeros(8))
    np.testing.assert_array_equal(lz_pen([]), np.zeros(8))


def test_lz_window_limits_the_sources():
    # window 2: only positions 3, 4 (tokens 1, 2) are visible; no match of length >= 1 ends
    # before the newest token, so 1 and 2 are singletons and 3 is a literal again.
    want = np.zeros(8)
    want[1] = -(3.0 - 1.0)
    want[2] = -(3.0 - 0.0)
    np.testing.assert_allclose(lz_pen([1, 2, 3, 1, 2], window=2), want, atol=1e-12)


def test_lz_buffer_caps_the_match_length():
    h = [5, 6, 7, 5, 6, 7]
    # buffer 2: the suffix match at s = 2 is capped at l = 2, d = 3 → token 5 extends it.
    want = np.zeros(8)
    want[5] = -(3.0 - (math.log2(1 - (3 - 2 + 1) / (2 * 3)) - 1))
    want[6] = -(3.0 - 1.0)
    want[7] = -(3.0 - 0.0)
    np.testing.assert_allclose(lz_pen(h, buffer=2), want, atol=1e-12)
    # buffer 32: l = 3, d = 3 → ΔC = log2(1 - 1/9) - 1.
    want[5] = -(3.0 - (math.log2(1 - (3 - 3 + 1) / (3 * 3)) - 1))
    np.testing.assert_allclose(lz_pen(h), want, atol=1e-12)


def test_lz_length_one_match_falls_back_to_distance():
    # h = 1 2 1: l = 1 (the "1" at s = 0); token 2 would make a length-2 match, but with l = 1
    # eq. 14's third case is log2 0, so it takes log2 δ = log2 2 = 1. V = 4 (log2 V = 2).
    want = np.zeros(4)
    want[2] = -(2.0 - 1.0)
    want[1] = -(2.0 - 0.0)
    np.testing.assert_allclose(lz_pen([1, 2, 1], v=4), want, atol=1e-12)


def test_lz_overlapping_run_and_literal_cap():
    # V = 2 (log2 V = 1), h = 0 1 1 1 1: the run "1 1 1" matches at distance 1 (l = 3, d = 1);
    # token 1 extends it: ΔC = log2(1 - (1-3+1)/(3·1)) - 1 = log2(4/3) - 1. Token 0 is at
    # distance 5, log2 5 > log2 V, so it is capped to a literal: penalty 0.
    want = np.array([0.0, -(1.0 - (math.log2(4 / 3) - 1))])
    np.testing.assert_allclose(lz_pen([0, 1, 1, 1, 1], v=2), want, atol=1e-12)


def lz_vectorised(logits, history, strength, w, b):
    """The spec note's vectorised recipe on one right-aligned [w] window (pad = -1)."""
    logits = np.asarray(logits, dtype=np.float64)
    v = len(logits)
    h = np.asarray(history, dtype=np.int64)
    if strength == 0.0 or len(h) == 0:
        return logits.copy()
    H = np.full(w, -1, dtype=np.int64)
    tail = h[-w:]
    H[w - len(tail):] = tail
    valid = H >= 0
    s = np.arange(w - 1)[:, None]
    k = np.arange(b)[None, :]
    idx = s - k
    inside = idx >= 0
    idxc = np.clip(idx, 0, w - 1)
    E = inside & valid[idxc] & (H[idxc] == H[w - 1 - np.minimum(k, w - 1)])
    E &= (k < w)                                           # k beyond the window never matches
    L = np.cumprod(E, axis=1).sum(axis=1)                  # [w-1]
    l = int(L.max()) if w > 1 else 0
    m = 1 + np.concatenate([[0], L])                       # m[j], j = 0..w-1
    j = np.arange(w)
    lam = np.zeros(v, dtype=np.int64)
    near = np.full(v, -1)
    ext = np.full(v, -1)
    np.maximum.at(lam, H[valid], m[valid])
    np.maximum.at(near, H[valid], j[valid])
    np.maximum.at(ext, H[valid], np.where(m == l + 1, j, -1)[valid])
    lv = math.log2(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        d_ext = (w - ext).astype(np.float64)
        f_ext = np.log2(1.0 - (d_ext - l + 1) / (l * d_ext)) - 1.0
        single = np.minimum(np.log2((w - near).astype(np.float64)), lv)
    delta = np.where(lam == 0, lv, np.where((l >= 2) & (lam == l + 1), f_ext, single))
    return logits - strength * (lv - delta)


@settings(max_examples=300, deadline=None)
@given(hist=st.lists(st.integers(0, 5), max_size=60), w=st.integers(1, 24),
       b=st.integers(1, 6), strength=st.sampled_from([0.0, 0.15, 1.0]))
def test_lz_loops_match_the_vectorised_recipe(hist, w, b, strength):
    logits = np.linspace(-2.0, 2.0, 6)
    got = ref.lz_penalty(logits, hist, strength, w, b)
    want = lz_vectorised(logits, hist, strength, w, b)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Bias and masks
# --------------------------------------------------------------------------------------------


def test_logit_bias_and_bans():
    np.testing.assert_allclose(ref.logit_bias([0.0, 1.0, 2.0], {0: 100, 2: -100.0}),
                               [100.0, 1.0, -98.0])
    with pytest.raises(ValueError):
        ref.logit_bias([0.0, 1.0], {2: 1.0})
    np.testing.assert_array_equal(ref.bans([1.0, 2.0, 3.0], [0, 2]), [NEG, 2.0, NEG])


def test_bad_words_vllm_semantics():
    gen = [4, 5]
    seqs = [[7], [5, 6], [4, 9, 8], [4, 5, 3], [1, 2, 3, 4, 5]]
    out = ref.bad_words(np.zeros(10), gen, seqs)
    # [7]: always; [5, 6]: gen ends with [5] → 6; [4, 9, 8]: no; [4, 5, 3]: gen ends with
    # [4, 5] → 3; [1, 2, 3, 4, 5]: longer than len(gen) + 1 → skipped.
    assert ids(np.isneginf(out)) == [3, 6, 7]
    # Nothing generated yet: only the single-token word applies.
    assert ids(np.isneginf(ref.bad_words(np.zeros(10), [], seqs))) == [7]


def test_min_tokens_masks_stops_until_reached():
    assert ids(np.isneginf(ref.min_tokens(np.zeros(5), 2, 3, [0, 4]))) == [0, 4]
    assert ids(np.isneginf(ref.min_tokens(np.zeros(5), 3, 3, [0, 4]))) == []
    # Through process: n_generated counts history[n_prompt:].
    x, kept = ref.process(np.zeros(5), [1, 1, 2], 1, {"min_tokens": 3, "stop_ids": [0]})
    assert np.isneginf(x[0]) and not kept[0]
    x, kept = ref.process(np.zeros(5), [1, 1, 2, 2], 1, {"min_tokens": 3, "stop_ids": [0]})
    assert x[0] == 0.0 and kept[0]


def test_top_n_sigma():
    row = [0.0, 1.0, 2.0, 3.0, NEG]
    # Finite: mean 1.5, σ = sqrt(1.25) ≈ 1.118; n = 1 keeps l >= 1.882.
    np.testing.assert_array_equal(ref.top_n_sigma(row, 1.0), [NEG, NEG, 2.0, 3.0, NEG])
    np.testing.assert_array_equal(ref.top_n_sigma(row, 2.0), [NEG, 1.0, 2.0, 3.0, NEG])
    np.testing.assert_array_equal(ref.top_n_sigma(row, 0.0), row)
    np.testing.assert_array_equal(ref.top_n_sigma(row, -1.0), row)
    # All equal: σ = 0, everything equals the max and stays.
    np.testing.assert_array_equal(ref.top_n_sigma([1.0, 1.0], 1.0), [1.0, 1.0])


# --------------------------------------------------------------------------------------------
# Kept-set stages
# --------------------------------------------------------------------------------------------

ALL4 = np.ones(4, bool)


def test_top_k_ties_and_kept():
    x = [1.0, 3.0, 2.0, 3.0]
    assert ids(ref.top_k(x, ALL4, 2)) == [1, 3]
    assert ids(ref.top_k(x, ALL4, 1)) == [1]                 # tie → lower id
    assert ids(ref.top_k(x, [True, False, True, True], 1)) == [3]
    assert ids(ref.top_k(x, ALL4, 0)) == [0, 1, 2, 3]
    assert ids(ref.top_k(x, ALL4, 9)) == [0, 1, 2, 3]


def test_top_p_smallest_prefix_reaching_p_renormalised():
    x = logp(0.5, 0.3, 0.2)
    assert ids(ref.top_p(x, np.ones(3, bool), 0.5)) == [0]     # 0.5 before token 1 is not < 0.5
    assert ids(ref.top_p(x, np.ones(3, bool), 0.6)) == [0, 1]
    assert ids(ref.top_p(x, np.ones(3, bool), 0.0)) == [0]     # at least one
    assert ids(ref.top_p(x, np.ones(3, bool), 1.0)) == [0, 1, 2]
    # Renormalised over kept {0, 1, 2} of [.4, .3, .2, .1]: [4/9, 3/9, 2/9]; p = 0.75 needs
    # two (mass before token 2 is 7/9 ≥ 0.75). Unnormalised it would take three (0.7 < 0.75).
    x = logp(0.4, 0.3, 0.2, 0.1)
    assert ids(ref.top_p(x, [True, True, True, False], 0.75)) == [0, 1]


def test_min_p():
    x = logp(0.5, 0.3, 0.15, 0.05)
    assert ids(ref.min_p(x, ALL4, 0.25)) == [0, 1, 2]            # ≥ 0.125
    assert ids(ref.min_p(x, ALL4, 0.5)) == [0, 1]                # ≥ 0.25
    assert ids(ref.min_p(x, ALL4, 0.0)) == [0, 1, 2, 3]
    assert ids(ref.min_p(x, [False, True, True, True], 0.6)) == [1]   # max is now 0.3


def test_typical_p_simple():
    # p = [.7, .2, .1]: H ≈ 0.8018; scores |−ln p − H| ≈ .445, .808, 1.501 → order 0, 1, 2.
    x = logp(0.7, 0.2, 0.1)
    k3 = np.ones(3, bool)
    assert ids(ref.typical_p(x, k3, 0.5)) == [0]          # cum .7 > .5
    assert ids(ref.typical_p(x, k3, 0.8)) == [0, 1]       # .7, then .9 > .8
    assert ids(ref.typical_p(x, k3, 0.95)) == [0, 1, 2]
    assert ids(ref.typical_p(x, k3, 1.0)) == [0, 1, 2]    # off


def test_typical_p_prefers_typical_over_probable():
    # p = [.4, .06 × 10]: H ≈ 2.0546; the top token's score is 1.138, each small one's 0.759.
    # The small ones come first (ids ascending); p = 0.33 stops at cum .36 > .33, 6 tokens.
    x = logp(0.4, *([0.06] * 10))
    assert ids(ref.typical_p(x, np.ones(11, bool), 0.33)) == [1, 2, 3, 4, 5, 6]
    # Only the top token stays if it alone is kept.
    kept = np.zeros(11, bool)
    kept[0] = True
    assert ids(ref.typical_p(x, kept, 0.33)) == [0]


def test_typical_p_renormalises_over_kept():
    # Kept {0, 1} of [.7, .2, .1]: renormalised [7/9, 2/9], H = 0.5297; scores .278, .974.
    # p = 0.75: cum 7/9 = .778 > .75 → keep only 0. Unnormalised .7 would not exceed .75.
    x = logp(0.7, 0.2, 0.1)
    assert ids(ref.typical_p(x, [True, True, False], 0.75)) == [0]


def test_xtc_removes_all_but_least_probable_above_threshold():
    x = logp(0.4, 0.3, 0.2, 0.1)
    # ≥ 0.25: tokens 0 and 1 → drop 0.
    assert ids(ref.xtc(x, ALL4, 0.25, 0.5, u=0.3)) == [1, 2, 3]
    # ≥ 0.15: tokens 0, 1, 2 → drop 0 and 1.
    assert ids(ref.xtc(x, ALL4, 0.15, 0.5, u=0.3)) == [2, 3]
    # Only one token above the threshold → nothing.
    assert ids(ref.xtc(x, ALL4, 0.35, 0.5, u=0.3)) == [0, 1, 2, 3]
    # The draw says no (u > probability), threshold > 0.5, probability 0 → nothing.
    assert ids(ref.xtc(x, ALL4, 0.25, 0.5, u=0.6)) == [0, 1, 2, 3]
    assert ids(ref.xtc(x, ALL4, 0.6, 1.0, u=0.0)) == [0, 1, 2, 3]
    assert ids(ref.xtc(x, ALL4, 0.25, 0.0, u=0.0)) == [0, 1, 2, 3]
    # u == probability still fires (only u > probability skips).
    assert ids(ref.xtc(x, ALL4, 0.25, 0.5, u=0.5)) == [1, 2, 3]


def test_xtc_renormalises_over_kept():
    # Kept {1, 2, 3}: [.5, .333, .167]; threshold .3 → tokens 1 and 2 qualify → drop 1.
    # Unnormalised (.3, .2, .1) only one token would qualify.
    x = logp(0.4, 0.3, 0.2, 0.1)
    assert ids(ref.xtc(x, [False, True, True, True], 0.3, 1.0, u=0.1)) == [2, 3]
    # Fewer than two kept → nothing.
    assert ids(ref.xtc(x, [False, False, False, True], 0.0, 1.0, u=0.1)) == [3]


# --------------------------------------------------------------------------------------------
# process: the fixed order
# --------------------------------------------------------------------------------------------


def test_process_defaults_are_identity():
    row = np.array([0.3, -1.2, 2.0, 0.0])
    x, kept = ref.process(row, [1, 2, 3], 1, {})
    np.testing.assert_array_equal(x, row)
    assert kept.all()


def test_process_greedy_returns_pre_temperature_logits_and_argmax():
    row = np.array([0.3, 2.0, 2.0, -1.0])
    x, kept = ref.process(row, [0], 1, {"temperature": 0.0, "top_k": 1, "xtc_probability": 1.0})
    np.testing.assert_array_equal(x, row)
    assert ids(kept) == [1]                                      # first of the tied maxima


def test_process_logit_bias_forces_and_bans():
    row = np.array([5.0, 0.0, 1.0])
    _, kept = ref.process(row, [0], 1, {"logit_bias": {1: 100.0}, "temperature": 0.0})
    assert ids(kept) == [1]
    _, kept = ref.process(row, [0], 1, {"logit_bias": {0: -100.0}, "temperature": 0.0})
    assert ids(kept) == [2]


def test_process_bias_comes_after_penalties_and_temperature_after_bias():
    # repetition 2 on token 0 (in history) then bias +1: 2/2 + 1 = 2 (the other way: 1.5).
    x, _ = ref.process([2.0, 0.0], [0], 1, {"repetition_penalty": 2.0, "logit_bias": {0: 1.0}})
    assert x[0] == 2.0
    x, _ = ref.process([2.0, 0.0], [0], 1, {"repetition_penalty": 2.0, "logit_bias": {0: 1.0},
                                           "temperature": 0.5})
    assert x[0] == 4.0


def test_process_masks_then_top_n_sigma_then_kept_stages():
    row = np.array([10.0, 0.0, 1.0, 2.0, 3.0])
    # Token 0 banned first: top-nσ statistics then come from [0, 1, 2, 3] only (σ ≈ 1.118).
    x, kept = ref.process(row, [0], 1, {"banned_ids": [0], "top_n_sigma": 1.0,
                                        "temperature": 2.0})
    np.testing.assert_array_equal(x, [NEG, NEG, NEG, 1.0, 1.5])
    assert ids(kept) == [3, 4]


def test_process_top_k_then_top_p_renormalised():
    x0 = logp(0.4, 0.3, 0.2, 0.1)
    # top_k = 3 then top_p 0.75 over [4/9, 3/9, 2/9] → {0, 1}.
    _, kept = ref.process(x0, [0], 1, {"top_k": 3, "top_p": 0.75})
    assert ids(kept) == [0, 1]
    _, kept = ref.process(x0, [0], 1, {"top_p": 0.75})
    assert ids(kept) == [0, 1, 2]


def test_process_xtc_needs_the_draw_and_runs_last():
    x0 = logp(0.4, 0.3, 0.2, 0.1)
    with pytest.raises(ValueError):
        ref.process(x0, [0], 1, {"xtc_probability": 0.5})
    _, kept = ref.process(x0, [0], 1, {"xtc_probability": 0.5, "xtc_threshold": 0.25,
                                        "xtc_u": 0.2, "top_k": 3})
    # After top_k 3: [4/9, 3/9, 2/9]; ≥ 0.25 are tokens 0 and 1 → drop 0.
    assert ids(kept) == [1, 2]


def test_process_rejects_unknown_params():
    with pytest.raises(KeyError):
        ref.process([0.0, 1.0], [0], 1, {"top_pp": 0.5})


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_prompt=st.integers(0, 10),
       n_gen=st.integers(0, 20), t=st.sampled_from([0.0, 0.7, 1.0, 1.5]))
def test_process_all_on_invariants(seed, n_prompt, n_gen, t):
    rng = np.random.default_rng(seed)
    v = 16
    logits = rng.standard_normal(v) * 3
    history = rng.integers(0, 4, n_prompt + n_gen)
    params = {
        "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2,
        "dry_multiplier": 0.8, "dry_breaker_ids": [3], "lz_penalty": 0.15, "lz_window": 8,
        "lz_buffer": 4, "logit_bias": {5: 2.0}, "banned_ids": [6], "bad_words": [[1, 2]],
        "min_tokens": 5, "stop_ids": [0], "top_n_sigma": 2.0, "temperature": t, "top_k": 8,
        "top_p": 0.9, "min_p": 0.05, "typical_p": 0.9, "xtc_probability": 0.5,
        "xtc_threshold": 0.1, "xtc_u": float(rng.random()),
    }
    x, kept = ref.process(logits, history, n_prompt, params)
    assert kept.any()
    assert np.isfinite(x[kept]).all()
    assert not kept[6] and np.isneginf(x[6])
    if n_gen < 5:
        assert not kept[0]
    if t == 0.0:
        assert kept.sum() == 1 and kept[int(np.argmax(x))]
    else:
        assert kept.sum() <= 8
