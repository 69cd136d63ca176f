"""The device sampler against a NumPy reference on random logits.

- The drawable set (`kept_mask`) equals the reference set exactly for a grid of
  temperature/top-k/top-p/min-p settings, peaked and flat logits, on both the candidate path
  (kept set within `CANDIDATES`) and the full-sort path (top_k or nucleus beyond it).
- Frequencies of many draws pass a chi-square test against the reference distribution.
- Greedy rows take the argmax; logprobs and top-N are the model's raw log-softmax.
- A row's draw depends only on its own logits, key and step, not on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from metrale_jax.engine.sampling import CANDIDATES, kept_mask, sample, seed_to_key
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from tests.conftest import RUN_FAST

V = 1000


def reference_probs(logits: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """The sampling distribution [V] (float64): temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64) / t
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-x, kind="stable")
    k_eff = k if 0 < k < len(x) else len(x)
    pk = probs[order[:k_eff]]
    before = np.cumsum(pk) - pk
    keep = np.zeros(len(x), bool)
    keep[order[:k_eff][(before < p * pk.sum()) | (p >= 1.0)]] = True  # top_p = 1: off
    keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def arrays(rows: list[tuple[float, int, float, float]], seed: int = 0,
           vocab: int = V) -> SamplingState:
    """Device settings of rows (temperature, top_k, top_p, min_p), every other control off."""
    n = len(rows)
    t, k, p, m = (np.array(c) for c in zip(*rows, strict=True))
    s = SamplingState.host_defaults(n, vocab)
    s = dataclasses.replace(s, temperature=t.astype(np.float32), top_k=k.astype(np.int32),
                            top_p=p.astype(np.float32), min_p=m.astype(np.float32),
                            keys=np.tile(seed_to_key(seed), (n, 1)))
    return jax.tree.map(jnp.asarray, s)


def no_history(rows: int, vocab: int = V) -> tuple[TokenHistory, jax.Array]:
    """An empty history (one stale position) and lengths of 1."""
    return TokenHistory.zeros(rows, 1, vocab), jnp.ones((rows,), jnp.int32)


GRID = list(itertools.product(
    (0.6, 1.0, 1.7),                                          # temperature
    (0, 1, 5, 50, CANDIDATES, CANDIDATES + 1, 300, V - 1, V, 5000),  # top_k
    (1.0, 0.97, 0.5, 0.1),                                    # top_p
    (0.0, 0.02, 0.3),                                         # min_p
))


@pytest.mark.parametrize("scale", [0.3, 3.0], ids=["flat", "peaked"])
def test_kept_set_is_exactly_the_reference(scale):
    rng = np.random.default_rng(0 if scale < 1 else 1)
    logits = (scale * rng.standard_normal((len(GRID), V))).astype(np.float32)
    s = arrays(GRID)
    x = jnp.asarray(logits) / s.temperature[:, None]
    got = np.asarray(jax.jit(kept_mask)(x, s))
    sizes = []
    for i, (t, k, p, m) in enumerate(GRID):
        want = reference_probs(logits[i], t, k, p, m) > 0
        assert (got[i] == want).all(), f"row {i}: t={t} k={k} p={p} min_p={m}"
        sizes.append(want.sum())
    # Both paths were exercised: kept sets inside and beyond the candidates.
    assert min(sizes) == 1 and max(sizes) > CANDIDATES


DRAWS = 20000
CHI_CASES = [(1.0, 0, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 0, 1.0, 0.1),
             (1.0, 300, 0.9, 0.0), (2.0, 40, 0.7, 0.05)]


def _draw_rows(lg, s, st):
    history, length = no_history(lg.shape[0], lg.shape[1])
    return sample(lg, s, history, length, st, 5)


@pytest.fixture(scope="module")
def draw_fn():
    return jax.jit(_draw_rows)


@pytest.fixture(scope="module")
def many_draws_fn():
    """`draw_fn` for DRAWS rows, whose run outweighs its compile: XLA's default options."""
    return jax.jit(_draw_rows, compiler_options=RUN_FAST)


@pytest.mark.parametrize("case", CHI_CASES, ids=str)
def test_draw_frequencies_chi_square(case, many_draws_fn):
    logits = (1.5 * np.random.default_rng(2).standard_normal(V)).astype(np.float32)
    s = arrays([case] * DRAWS, seed=11)
    out = many_draws_fn(jnp.broadcast_to(jnp.asarray(logits), (DRAWS, V)), s,
                  jnp.arange(DRAWS, dtype=jnp.int32))
    tokens = np.asarray(out.tokens)
    probs = reference_probs(logits, *case)
    assert (probs[tokens] > 0).all(), "drew a token outside the kept set"
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    expected = probs * DRAWS
    big = expected >= 5  # pool the small bins so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > 1e-4, f"{case}: chi-square p = {p_value:.2e}"


def test_greedy_logprobs_and_top(draw_fn):
    """Six rows, the batch of `test_row_draw_ignores_the_rest_of_the_batch` (one compile of
    `draw_fn` for both): two greedy, four sampled."""
    rng = np.random.default_rng(3)
    logits = (2.0 * rng.standard_normal((6, V))).astype(np.float32)
    s = arrays([(0.0, 0, 1.0, 0.0), (0.0, 5, 0.5, 0.2), (1.0, 0, 1.0, 0.0), (0.5, 3, 1.0, 0.0),
                (1.0, 40, 0.9, 0.0), (0.7, 0, 1.0, 0.05)])
    out = draw_fn(jnp.asarray(logits), s, jnp.zeros(6, jnp.int32))
    ref_lp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    tokens = np.asarray(out.tokens)
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()
    np.testing.assert_allclose(out.logprobs, np.asarray(ref_lp)[np.arange(6), tokens], rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1)[:, :5])
    best = np.sort(np.asarray(ref_lp), axis=-1)[:, ::-1][:, :5]
    np.testing.assert_allclose(out.top_logprobs, best, rtol=1e-6)


def test_row_draw_ignores_the_rest_of_the_batch(draw_fn):
    rng = np.random.default_rng(4)
    logits = (0.5 * rng.standard_normal((6, V))).astype(np.float32)
    rows = [(1.0, 0, 0.99, 0.0), (1.0, 400, 1.0, 0.0), (0.8, 10, 0.9, 0.0), (1.0, 0, 1.0, 0.0),
            (0.0, 0, 1.0, 0.0), (1.2, 0, 1.0, 0.01)]
    keys = np.stack([seed_to_key(i) for i in range(6)])
    s = arrays(rows)
    s = dataclasses.replace(s, keys=jnp.asarray(keys))
    steps = jnp.arange(6, dtype=jnp.int32) + 3
    together = np.asarray(draw_fn(jnp.asarray(logits), s, steps).tokens)
    for i in range(6):
        alone = draw_fn(jnp.asarray(logits[i:i + 1]), jax.tree.map(lambda a, i=i: a[i:i + 1], s),
                        steps[i:i + 1])
        assert int(alone.tokens[0]) == together[i], f"row {i} {rows[i]}"


def test_candidate_draw_equals_full_vocabulary_draw():
    """The fast path (draw over the top candidates) picks the token the full-vocabulary
    draw with the same per-token noise picks, for every row and many seeds."""
    from metrale_jax.engine.sampling import _draw, _token_noise, step_keys

    B, V = 6, 3000
    x = jax.random.normal(jax.random.key(0), (B, V)) * 2.0
    st = arrays([(1.0, 5, 1.0, 0.0), (1.0, 40, 0.9, 0.0), (1.0, 0, 0.5, 0.0),
                 (1.0, 0, 0.95, 0.05), (1.0, 300, 1.0, 0.0), (1.0, 1, 1.0, 0.0)], vocab=V)
    st = dataclasses.replace(st, keys=jnp.zeros((B, 2), jnp.uint32))
    keep = jax.jit(kept_mask)(x, st)

    # One program for all seeds (op by op, each primitive compiles on its own); the logits and
    # settings are its arguments, not constants (XLA would fold their sorts at compile time).
    @jax.jit
    def both(x, st, keep, steps):
        row_keys = step_keys(st, steps)
        got = _draw(x, st, row_keys, want_keep=False).tokens
        g = jax.vmap(lambda k: _token_noise(k, jnp.arange(V)))(row_keys)
        return got, jnp.argmax(jnp.where(keep, x + g, -jnp.inf), axis=-1)

    for seed in range(20):
        got, want = both(x, st, keep, jnp.full((B,), seed, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
