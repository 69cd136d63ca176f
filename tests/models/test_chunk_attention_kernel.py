"""The CPU prefill-chunk attention kernel (`metrale_jax/kernels/chunk_attention.py`) against
XLA's item loop (`chunk_attention(..., kernel=False)`) and the dense float64 reference of
`test_paged_attention.chunk_reference`'s contract.

Bound: the kernel sums the same float32 terms in another order (blocks of 64 positions, a
polynomial exp), so it differs from XLA's loop by rounding: measured up to ~4e-7 of the
largest output on these inputs; 1e-5 leaves 25x. A wrong page, position, head or mask moves
an output by O(1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.kernels import chunk_attention as kernel
from metrale_jax.models.kv_quant import dequantize_rows, quantize_rows
from metrale_jax.models.paged_attention import chunk_attention

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C++ compiler")

BOUND = 1e-5


def _inputs(H: int, K: int, D: int, ps: int, pieces: list[tuple[int, int, int]], C: int,
            seed: int = 0, int8: bool = False):
    """Chunk arguments for pieces (row, first position, length) in that order, padding
    after. Returns (q, k, v, tok_seq, tok_pos, pages, table)."""
    rng = np.random.default_rng(seed)
    S = max(r for r, _, _ in pieces) + 1
    pps = max(-(-(p + n) // ps) for _, p, n in pieces) + 1
    N = 1 + S * pps
    q = rng.standard_normal((C, H, D)).astype(np.float32)
    k = rng.standard_normal((C, K, D)).astype(np.float32)
    v = rng.standard_normal((C, K, D)).astype(np.float32)
    pages = jnp.asarray(rng.standard_normal((N, ps, 2 * K, D)) * 2, jnp.float32)
    if int8:
        pages = quantize_rows(pages)
        # the chunk's own keys as an int8 pool stores them (what a step passes)
        k, v = (np.asarray(dequantize_rows(quantize_rows(jnp.asarray(x)))) for x in (k, v))
    table = rng.permutation(np.arange(1, N)).reshape(S, pps).astype(np.int32)
    pad = C - sum(n for _, _, n in pieces)
    seq = np.concatenate([[r] * n for r, _, n in pieces] + [[-1] * pad]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in pieces] + [[0] * pad])
    return q, k, v, seq, pos.astype(np.int32), pages, table


@functools.cache
def _fn(use_kernel: bool, window: int | None, cap: float | None, scale: float,
        q_tile: int = kernel.Q_TILE):
    if use_kernel:
        return jax.jit(functools.partial(kernel.chunk_attention, sm_scale=scale,
                                         sliding_window=window, soft_cap=cap, q_tile=q_tile))
    return jax.jit(functools.partial(chunk_attention, sm_scale=scale, sliding_window=window,
                                     soft_cap=cap, kernel=False))


# Pieces: long contexts over many 64-position blocks, a fresh one, a one-token piece, one
# ending on a page edge; rows out of order.
PIECES = [(2, 150, 37), (0, 0, 20), (3, 63, 1), (1, 200, 70), (4, 17, 15)]


@pytest.mark.parametrize("H,K,D,ps", [(9, 3, 64, 16), (4, 4, 16, 8), (8, 2, 24, 4)])
@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (None, 30.0), (9, 5.0)])
def test_kernel_equals_xla_loop(H, K, D, ps, window, cap):
    C = 150
    args = _inputs(H, K, D, ps, PIECES, C)
    got = np.asarray(_fn(True, window, cap, D ** -0.5)(*args))
    want = np.asarray(_fn(False, window, cap, D ** -0.5)(*args))
    assert got.shape == want.shape == (C, H, D) and got.dtype == np.float32
    real = args[3] >= 0
    assert np.all(got[~real] == 0)  # padding
    assert np.abs(got[real] - want[real]).max() <= BOUND * np.abs(want[real]).max()


@pytest.mark.parametrize("window", [None, 50])
def test_kernel_int8_pool_equals_xla_loop(window):
    C = 150
    args = _inputs(9, 3, 64, 16, PIECES, C, seed=3, int8=True)
    assert args[5].dtype == jnp.int8
    got = np.asarray(_fn(True, window, None, 0.125)(*args))
    want = np.asarray(_fn(False, window, None, 0.125)(*args))
    real = args[3] >= 0
    assert np.abs(got[real] - want[real]).max() <= BOUND * np.abs(want[real]).max()


def dense_reference(q, k, v, seq, pos, pages, table, *, scale, window=None, cap=None):
    """The contract densely in float64: each real token t of a piece starting at position p0
    sees its row's positions 0 .. p0 - 1 from the pages and its piece's tokens up to itself
    (and, with a window w, only keys with pos[t] - key position < w)."""
    pages = np.asarray(dequantize_rows(pages) if pages.dtype == jnp.int8 else pages,
                       np.float64)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H = q.shape[1]
    ps, K = pages.shape[1], k.shape[1]
    out = np.zeros(q.shape)
    for t in np.flatnonzero(seq >= 0):
        first = t
        while first > 0 and seq[first - 1] == seq[t] and pos[first - 1] == pos[first] - 1:
            first -= 1
        ctx = np.arange(pos[first])
        cache = pages[table[seq[t], ctx // ps], ctx % ps]  # [ctx, 2K, D]
        own = np.arange(first, t + 1)
        keys = np.concatenate([cache[:, 0::2], k[own]])  # [L, K, D]
        vals = np.concatenate([cache[:, 1::2], v[own]])
        kpos = np.concatenate([ctx, pos[own]])
        vis = pos[t] - kpos < (window or 2**30)
        for h in range(H):
            s = keys[vis, h // (H // K)] @ q[t, h] * scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            w = np.exp(s - s.max())
            out[t, h] = w @ vals[vis, h // (H // K)] / w.sum()
    return out


@pytest.mark.parametrize("window,cap,int8", [(None, None, False), (9, 5.0, False),
                                             (40, None, True)])
def test_kernel_matches_the_dense_reference(window, cap, int8):
    C = 150
    args = _inputs(8, 2, 24, 4, PIECES, C, seed=7, int8=int8)
    ref = dense_reference(*args, scale=0.2, window=window, cap=cap)
    got = np.asarray(_fn(True, window, cap, 0.2)(*args))
    real = args[3] >= 0
    np.testing.assert_allclose(got[real], ref[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_tile", [1, 7, 64])
def test_a_piece_gives_the_same_bits_alone_and_beside_others(q_tile):
    C = 150
    q, k, v, seq, pos, pages, table = _inputs(9, 3, 64, 16, PIECES, C, seed=5)
    fn = _fn(True, 30, None, 0.125, q_tile)
    full = np.asarray(fn(q, k, v, seq, pos, pages, table))
    at = 0
    for r, p, n in PIECES:
        sel = np.arange(at, at + n)
        perm = np.concatenate([sel, np.setdiff1d(np.arange(C), sel)])
        alone_seq = np.where(np.arange(C) < n, r, -1).astype(np.int32)
        alone_pos = np.where(np.arange(C) < n, p + np.arange(C), 0).astype(np.int32)
        alone = np.asarray(fn(q[perm], k[perm], v[perm], alone_seq, alone_pos, pages, table))
        np.testing.assert_array_equal(alone[:n], full[sel])
        at += n
    # another tile size: the same values up to rounding
    other = np.asarray(_fn(True, 30, None, 0.125, 128)(q, k, v, seq, pos, pages, table))
    assert np.abs(other - full).max() <= BOUND * np.abs(full).max()


def test_the_kernel_is_in_the_program_only_where_it_should_be(monkeypatch):
    q, k, v, seq, pos, pages, table = _inputs(9, 3, 64, 16, PIECES[:2], 64)
    f = functools.partial(chunk_attention, sm_scale=0.125, sliding_window=None, soft_cap=None)
    args = (q, k, v, seq, pos, pages, table)
    assert kernel.TARGET in jax.jit(f).lower(*args).as_text()
    off = jax.jit(functools.partial(f, kernel=False)).lower(*args).as_text()
    assert kernel.TARGET not in off
    b16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    hlo16 = jax.jit(f).lower(*b16, seq, pos, jnp.asarray(pages, jnp.bfloat16), table).as_text()
    assert kernel.TARGET not in hlo16  # the kernel is float32
    monkeypatch.setenv("METRALE_CHUNK_ATTENTION_KERNEL", "0")
    assert not kernel.available()
    g = functools.partial(chunk_attention, sm_scale=0.125, sliding_window=None, soft_cap=None)
    assert kernel.TARGET not in jax.jit(g).lower(*args).as_text()  # a new trace
