"""Every sampling control on the device against its NumPy reference (sampling_reference.py).

On random logits and random histories (hypothesis draws the settings and a NumPy seed) the
device's processed logits match the reference's to 1e-5 (relative for large penalties) with
-inf at the same places, and the kept (drawable) token sets are identical, for each control
alone and for all of them together. The vocabulary is wider than the sampler's candidate set,
so the candidate, band and full-sort paths are all exercised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.engine.logits_processors import LZ_BUFFER, LZ_WINDOW, process_logits
from metrale_jax.engine.sampling import (
    CANDIDATES,
    WIDE_CANDIDATES,
    kept_mask,
    step_keys,
    xtc_uniforms,
)
from metrale_jax.engine.sampling_state import DRY_WINDOW, TokenHistory
from metrale_jax.engine.state import SlotSettings, settings_to_arrays
from tests.engine import sampling_reference as ref

V = 700
N = 1200  # history positions held on the device (beyond the DRY and LZ windows)
assert V > CANDIDATES and max(DRY_WINDOW, LZ_WINDOW) < N
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _device_fn():
    def run(logits, s, tokens, counts, seen, length, steps):
        h = TokenHistory(tokens, counts, seen)
        proc = process_logits(logits, s, h, length, steps)
        t = s.temperature[:, None]
        x = proc / jnp.where(t > 0, t, 1.0)
        kept = kept_mask(x, s, steps)
        return proc, x, kept, xtc_uniforms(step_keys(s, steps))
    return jax.jit(run)


def run_device(logits: np.ndarray, history: np.ndarray, n_prompt: int, slot: SlotSettings):
    """(processed logits [V], tempered [V], kept [V], the row's XTC uniform) on the device."""
    n = len(history)
    tokens = np.zeros((1, N), np.int32)
    tokens[0, :n] = history
    counts = np.bincount(history[n_prompt:], minlength=V).astype(np.int32)[None]
    seen = np.zeros((1, V), bool)
    seen[0, history[:n_prompt]] = True
    s = jax.tree.map(jnp.asarray, settings_to_arrays([slot], 1, V))
    proc, x, kept, u = _device_fn()(jnp.asarray(logits[None]), s, tokens, counts, seen,
                                    np.array([n], np.int32), np.array([n - n_prompt], np.int32))
    return np.asarray(proc[0]), np.asarray(x[0]), np.asarray(kept[0]), float(u[0])


def assert_logits_close(got: np.ndarray, want: np.ndarray) -> None:
    """Same -inf positions; finite entries within 1e-5 (relative beyond magnitude 1)."""
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
    assert err.max(initial=0.0) <= 1e-5, f"max error {err.max():.2e}"


@st.composite
def cases(draw, controls: tuple[str, ...]):
    """(logits, history, n_prompt, reference params, device SlotSettings)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.3, 1.0, 3.0, 8.0]))
    logits = (scale * rng.standard_normal(V)).astype(np.float32)
    alphabet = draw(st.sampled_from([4, 12, 60, V]))
    n = draw(st.sampled_from([1, 2, 5, 30, 200, 700, N - 1]))
    history = rng.integers(0, alphabet, n).astype(np.int32)
    if draw(st.integers(0, 3)):  # a repeated block at the end: long matches for DRY and LZ
        period = int(rng.integers(1, 9))
        reps = int(rng.integers(2, 12))
        block = rng.integers(0, alphabet, period)
        tail = np.tile(block, reps)[: n]
        history[n - len(tail):] = tail
    n_prompt = int(rng.integers(0, n + 1))
    p: dict = {"temperature": 1.0}
    if "temperature" in controls:
        p["temperature"] = draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))
    if "repetition" in controls:
        p["repetition_penalty"] = draw(st.sampled_from([0.7, 1.3, 2.0]))
    if "presence_frequency" in controls:
        p["presence_penalty"] = draw(st.floats(-2, 2))
        p["frequency_penalty"] = draw(st.floats(-2, 2))
    if "dry" in controls:
        p["dry_multiplier"] = draw(st.sampled_from([0.8, 2.0]))
        p["dry_base"] = draw(st.sampled_from([1.0, 1.000001, 1.75, 3.0, 40.0]))
        p["dry_allowed_length"] = draw(st.integers(0, 4))
        p["dry_penalty_last_n"] = draw(st.sampled_from([-1, -1, 0, 1, 3, 16, 500]))
        p["dry_breaker_ids"] = tuple(int(i) for i in rng.choice(
            alphabet, size=draw(st.integers(0, 2)), replace=False))
    if "lz" in controls:
        p["lz_penalty"] = draw(st.sampled_from([0.05, 0.2, 1.0]))
    if "logit_bias" in controls:
        ids = rng.choice(V, size=draw(st.integers(1, 20)), replace=False)
        p["logit_bias"] = {int(i): float(rng.uniform(-100, 100)) for i in ids}
    if "masks" in controls:
        p["banned_ids"] = tuple(int(i) for i in rng.choice(V, draw(st.integers(0, 5)), False))
        words = []
        for _ in range(draw(st.integers(0, 6))):
            length = int(rng.integers(2, 5))
            if draw(st.booleans()) and n >= length - 1:  # the sequence's tail (may reach
                # back into the prompt, where it must not count)
                words.append((*(int(t) for t in history[n - length + 1:]),
                              int(rng.integers(0, V))))
            else:
                words.append(tuple(int(t) for t in rng.integers(0, alphabet, length)))
        p["bad_words"] = tuple(words)
        p["min_tokens"] = draw(st.integers(0, 3)) * max(1, n - n_prompt)
        p["stop_ids"] = tuple(int(i) for i in rng.choice(V, 3, replace=False))
    if "top_n_sigma" in controls:
        p["top_n_sigma"] = draw(st.sampled_from([0.5, 1.5, 3.0]))
    if "truncation" in controls:
        p["top_k"] = draw(st.sampled_from([0, 1, 5, 50, CANDIDATES, CANDIDATES + 40,
                                           WIDE_CANDIDATES + 100, V]))
        p["top_p"] = draw(st.sampled_from([1.0, 0.97, 0.6, 0.1]))
        p["min_p"] = draw(st.sampled_from([0.0, 0.02, 0.3]))
    if "typical" in controls:
        p["typical_p"] = draw(st.sampled_from([0.99, 0.9, 0.5, 0.2]))
    if "xtc" in controls:
        p["xtc_threshold"] = draw(st.sampled_from([0.001, 0.05, 0.1, 0.3, 0.6]))
        p["xtc_probability"] = draw(st.sampled_from([0.5, 1.0, 1.0]))
    words = p.get("bad_words", ())
    slot = SlotSettings(
        temperature=p["temperature"], top_k=p.get("top_k", 0), top_p=p.get("top_p", 1.0),
        min_p=p.get("min_p", 0.0), seed=int(rng.integers(0, 2**31)),
        typical_p=p.get("typical_p", 1.0), xtc_threshold=p.get("xtc_threshold", 0.1),
        xtc_probability=p.get("xtc_probability", 0.0), top_n_sigma=p.get("top_n_sigma", 0.0),
        repetition_penalty=p.get("repetition_penalty", 1.0),
        presence_penalty=p.get("presence_penalty", 0.0),
        frequency_penalty=p.get("frequency_penalty", 0.0),
        dry_multiplier=p.get("dry_multiplier", 0.0), dry_base=p.get("dry_base", 1.75),
        dry_allowed_length=p.get("dry_allowed_length", 2),
        dry_penalty_last_n=p.get("dry_penalty_last_n", -1),
        dry_breaker_ids=p.get("dry_breaker_ids", ()), lz_penalty=p.get("lz_penalty", 0.0),
        min_tokens=p.get("min_tokens", 0), stop_ids=p.get("stop_ids", ()),
        logit_bias=tuple(p.get("logit_bias", {}).items()),
        banned_ids=p.get("banned_ids", ()) + tuple(w[0] for w in words if len(w) == 1),
        bad_words=tuple(w for w in words if len(w) > 1))
    return logits, history, n_prompt, p, slot


def check(case) -> None:
    logits, history, n_prompt, p, slot = case
    proc, x, kept, u = run_device(logits, history, n_prompt, slot)
    p = {**p, "lz_window": LZ_WINDOW, "lz_buffer": LZ_BUFFER}
    if p.get("xtc_probability", 0.0) > 0:
        p["xtc_u"] = u
    want_proc, want_kept = ref.process(logits.astype(np.float64), history, n_prompt, p)
    if p["temperature"] == 0:
        assert_logits_close(proc, want_proc)
        assert int(np.argmax(proc)) == int(np.flatnonzero(want_kept)[0])
        return
    assert_logits_close(x, want_proc)
    # The reference's kept set from the device's own tempered logits: rounding in the
    # processors must not decide a borderline top-p / typical cut.
    np.testing.assert_array_equal(kept, ref.process(
        x.astype(np.float64), history, n_prompt,
        {k: v for k, v in p.items() if k in ("top_k", "top_p", "min_p", "typical_p",
                                             "xtc_threshold", "xtc_probability", "xtc_u")})[1])


ALONE = ["repetition", "presence_frequency", "dry", "lz", "logit_bias", "masks", "top_n_sigma",
         "truncation", "typical", "xtc"]


def _alone(control: str):
    @SETTINGS
    @given(cases((control,)))
    def test(case):
        check(case)

    test.__name__ = test.__qualname__ = f"test_{control}_alone_matches_the_reference"
    return test


# One test per control, each with its own name (hypothesis derives its examples from it).
for _control in ALONE:
    globals()[f"test_{_control}_alone_matches_the_reference"] = _alone(_control)


@SETTINGS
@given(cases((*ALONE, "temperature")))
def test_every_control_together_matches_the_reference(case):
    check(case)


def test_off_controls_leave_the_logits_bit_identical():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(V).astype(np.float32)
    history = rng.integers(0, 20, 100).astype(np.int32)
    proc, _, _, _ = run_device(logits, history, 50, SlotSettings(temperature=1.0))
    np.testing.assert_array_equal(proc, logits)
