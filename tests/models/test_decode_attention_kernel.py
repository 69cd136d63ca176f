"""The CPU paged decode attention kernel (`metrale_jax/kernels/decode_attention.py`) against
XLA's block loop (`decode_attention(..., kernel=False)`), which the fidelity tests check
against transformers.

Bound: both compute the same float32 sums in another order (the kernel page by page, XLA in
blocks of 64 positions), so they differ by rounding: measured up to 3e-7 of the largest output
on these inputs; 1e-5 leaves 30x for other contexts. A wrong page, position or head moves an
output by O(1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.kernels import decode_attention as kernel
from metrale_jax.models.paged_attention import decode_attention

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C++ compiler")

BOUND = 1e-5


def _inputs(H: int, K: int, D: int, ps: int, lens: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    n, pps = len(lens), max(1, -(-max(lens) // ps)) + 1
    N = 1 + n * pps
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    pages = rng.standard_normal((N, ps, 2 * K, D)).astype(np.float32)
    table = rng.permutation(np.arange(1, N)).reshape(n, pps).astype(np.int32)
    return q, pages, table, np.asarray(lens, np.int32)


@functools.cache
def _fn(use_kernel: bool, window: int | None, cap: float | None, scale: float):
    return jax.jit(functools.partial(decode_attention, sm_scale=scale, sliding_window=window,
                                     soft_cap=cap, kernel=use_kernel))


@pytest.mark.parametrize("H,K,D,ps", [(9, 3, 64, 16), (4, 4, 16, 8), (8, 2, 24, 4)])
@pytest.mark.parametrize("window,cap", [(None, None), (20, None), (None, 30.0), (7, 5.0)])
def test_kernel_equals_xla_loop(H, K, D, ps, window, cap):
    lens = [0, 1, ps, ps + 1, 100, 173]  # idle row, one position, page edges, many pages
    args = _inputs(H, K, D, ps, lens)
    got = np.asarray(_fn(True, window, cap, D ** -0.5)(*args))
    want = np.asarray(_fn(False, window, cap, D ** -0.5)(*args))
    assert got.shape == want.shape == (len(lens), H, D) and got.dtype == np.float32
    assert np.all(got[0] == 0)  # the idle row
    assert np.abs(got - want).max() <= BOUND * np.abs(want).max()


def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    q, pages, table, lens = _inputs(9, 3, 64, 16, [0, 300, 5, 64, 17, 1000])
    fn = _fn(True, None, None, 0.125)
    batch = np.asarray(fn(q, pages, table, lens))
    for r in range(len(lens)):
        alone = np.asarray(fn(q[r:r + 1], pages, table[r:r + 1], lens[r:r + 1]))
        np.testing.assert_array_equal(alone[0], batch[r])


def test_the_kernel_is_in_the_program_only_where_it_should_be(monkeypatch):
    q, pages, table, lens = _inputs(9, 3, 64, 16, [3, 40])
    hlo = _fn(True, None, None, 0.125).lower(q, pages, table, lens).as_text()
    assert kernel.TARGET in hlo
    assert kernel.TARGET not in _fn(False, None, None, 0.125).lower(q, pages, table,
                                                                   lens).as_text()
    # bfloat16 pools and queries keep XLA's loop (the kernel is float32)
    hlo16 = jax.jit(functools.partial(decode_attention, sm_scale=0.125, sliding_window=None,
                                      soft_cap=None)).lower(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(pages, jnp.bfloat16), table, lens).as_text()
    assert kernel.TARGET not in hlo16
    monkeypatch.setenv("METRALE_DECODE_ATTENTION_KERNEL", "0")
    assert not kernel.available()
    off = jax.jit(functools.partial(decode_attention, sm_scale=0.125, sliding_window=None,
                                    soft_cap=None)).lower(q, pages, table, lens).as_text()
    assert kernel.TARGET not in off
