"""Paged attention's XLA path against JAX's reference `ref_ragged_paged_attention`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from metrale_jax.models.paged_attention import (
    chunk_attention,
    decode_attention,
    ragged_paged_attention,
    use_tpu_kernel,
    write_kv,
)

K, G, D = 2, 2, 8  # kv heads, query heads per kv head, head dim
H = K * G
PS, PPS = 4, 8  # page size, pages per sequence
MAX_LEN = PS * PPS
S = 8  # rows of the page table (max sequences)
N = 1 + S * PPS  # pages, page 0 the null page
SCALE = D**-0.5

rpa = jax.jit(ragged_paged_attention, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "mask_value", "num_decode", "block_pages",
    "q_block", "ctx_q_block"))
# Loops of several blocks at these tiny sizes; pieces cut into several context items.
SMALL = {"block_pages": 1, "q_block": 4, "ctx_q_block": 2}


def make_batch(seed: int, decode_lens: list[int], prefill: list[tuple[int, int]], T: int):
    """A random batch: decode rows of the given kv lengths, then prefill sequences given as
    (q_len, ctx_len), then T - tokens padding tokens. Returns the kernel's arguments."""
    rng = np.random.default_rng(seed)
    q_lens = [1] * len(decode_lens) + [q for q, _ in prefill]
    kv_lens = list(decode_lens) + [q + c for q, c in prefill]
    num_seqs = len(q_lens)
    assert num_seqs <= S and sum(q_lens) <= T and max(kv_lens) <= MAX_LEN
    free = list(rng.permutation(np.arange(1, N)))
    # Unused table entries and rows past num_seqs hold random pages: they must never be read.
    table = rng.integers(0, N, (S, PPS)).astype(np.int32)
    for i, kv_len in enumerate(kv_lens):
        for j in range(-(-kv_len // PS)):
            table[i, j] = free.pop()
    kv_all = np.zeros(S, np.int32)
    kv_all[:num_seqs] = kv_lens
    kv_all[num_seqs:] = rng.integers(0, MAX_LEN + 1, S - num_seqs)  # ignored past num_seqs
    cu = np.full(S + 1, sum(q_lens), np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    pages = rng.standard_normal((N, PS, 2 * K, D)).astype(np.float32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(pages), jnp.asarray(kv_all), jnp.asarray(table),
            jnp.asarray(cu), jnp.asarray([num_seqs], jnp.int32))


def check(args, num_decode: int, **kw):
    """Our output against the reference's on the valid tokens; all tokens finite."""
    q, pages, kv_lens, table, cu, num_seqs = args
    out = np.asarray(rpa(*args, sm_scale=SCALE, num_decode=num_decode, **kw))
    for name in ("block_pages", "q_block", "ctx_q_block"):
        kw.pop(name, None)
    ref = np.asarray(ref_ragged_paged_attention(
        q, pages, kv_lens, table, cu, num_seqs, sm_scale=SCALE, **kw))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[: ref.shape[0]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [{}, SMALL])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_matches_reference(seed, sliding_window, soft_cap, blocks):
    # Several prefill sequences with context at once (at least two), anywhere in the chunk;
    # odd seeds have no decode rows.
    rng = np.random.default_rng(100 + seed)
    n_dec = 0 if seed % 2 else int(rng.integers(1, 4))
    decode_lens = [int(x) for x in rng.integers(1, MAX_LEN + 1, n_dec)]
    prefill = []
    for j in range(int(rng.integers(2, S - n_dec + 1))):
        q_len = int(rng.integers(1, 7))
        ctx = int(rng.integers(1, MAX_LEN - q_len + 1)) if j < 2 or rng.random() < 0.5 else 0
        prefill.append((q_len, ctx))
    prefill = [prefill[i] for i in rng.permutation(len(prefill))]  # context anywhere
    args = make_batch(seed, decode_lens, prefill, T=48)
    check(args, n_dec, sliding_window=sliding_window, soft_cap=soft_cap, **blocks)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_prefill_only(sliding_window):
    args = make_batch(7, [], [(5, 0), (6, 13), (3, 0), (1, 20)], T=16)
    check(args, 0, sliding_window=sliding_window, **SMALL)


def test_fresh_prefill_only_default_blocks():
    args = make_batch(8, [], [(5, 0), (7, 0)], T=14)
    check(args, 0)


@pytest.mark.parametrize("T", [4, 6])  # exactly the decode rows; or two padding tokens after
def test_decode_only(T):
    args = make_batch(9, [32, 1, 9, 17], [], T=T)
    check(args, 4, **SMALL)
    check(args, 4, sliding_window=4, soft_cap=2.0)


def test_idle_decode_rows_and_padding_are_finite():
    # num_decode 4 but only 2 sequences: rows 2 and 3 are idle; tokens 4.. are padding.
    q, pages, kv_lens, table, cu, _ = make_batch(10, [5, 20, 3, 3], [], T=8)
    num_seqs = jnp.asarray([2], jnp.int32)
    out = np.asarray(rpa(q, pages, kv_lens, table, cu, num_seqs, sm_scale=SCALE,
                         num_decode=4, **SMALL))
    assert np.isfinite(out).all()
    ref = np.asarray(ref_ragged_paged_attention(q, pages, kv_lens, table, cu, num_seqs,
                                                sm_scale=SCALE))
    np.testing.assert_allclose(out[:2], ref, rtol=1e-5, atol=1e-5)


def test_decode_kv_len_zero_is_zero():
    _, pages, _, table, _, _ = make_batch(11, [5, 5, 5], [], T=3)
    q = jnp.ones((3, H, D), jnp.float32)
    kv_lens = jnp.asarray([0, 6, 0], jnp.int32)
    out = decode_attention(q, pages, table[:3], kv_lens, sm_scale=SCALE, sliding_window=2,
                           soft_cap=None)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[[0, 2]], 0.0)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_same_for_every_block_size_and_alone(window):
    # The block loop's size and the other rows' lengths (more blocks for the longest) change
    # nothing in a row's result: masked blocks add exact zeros.
    q, pages, kv_lens, table, _, _ = make_batch(12, [7, 3, 30], [], T=3)
    f = jax.jit(functools.partial(decode_attention, sm_scale=SCALE, sliding_window=window,
                                  soft_cap=None), static_argnames="block_pages")
    outs = [np.asarray(f(q, pages, table[:3], kv_lens[:3], block_pages=bp)) for bp in (1, 2, 8)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-6, atol=1e-6)
    alone = np.asarray(f(q[:2], pages, table[:2], kv_lens[:2], block_pages=1))
    np.testing.assert_array_equal(alone, outs[0][:2])


def chunk_reference(q, k, v, tok_seq, tok_pos, pages, table, *, window=None, soft_cap=None):
    """chunk_attention's contract, densely in numpy (float64): each real token against its
    own piece's chunk tokens and its row's context `0 .. p0 - 1` from the pages."""
    q, k, v, pages, table = (np.asarray(x, np.float64) if i < 4 else np.asarray(x)
                             for i, x in enumerate((q, k, v, pages, table)))
    tok_seq, tok_pos = np.asarray(tok_seq), np.asarray(tok_pos)
    out = np.zeros(q.shape)
    for t in np.flatnonzero(tok_seq >= 0):
        row, p = tok_seq[t], tok_pos[t]
        first = t
        while first > 0 and tok_seq[first - 1] == row and tok_pos[first - 1] == tok_pos[first] - 1:
            first -= 1
        ctx = np.arange(tok_pos[first])
        cache = pages[table[row, ctx // PS], ctx % PS]  # [ctx, 2K, D]
        own = (tok_seq == row) & (tok_pos <= p)
        keys = np.concatenate([cache[:, 0::2], k[own]])  # [L, K, D]
        vals = np.concatenate([cache[:, 1::2], v[own]])
        kpos = np.concatenate([ctx, tok_pos[own]])
        vis = p - kpos < (window or 2**30)
        for h in range(H):
            s = keys[vis, h // G] @ q[t, h] * SCALE
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            w = np.exp(s - s.max())
            out[t, h] = w @ vals[vis, h // G] / w.sum()
    return out


def _chunk_inputs(seed: int, C: int):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((C, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((C, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((C, K, D)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((N, PS, 2 * K, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, N)).reshape(S, PPS), jnp.int32)
    return q, k, v, pages, table


chunk = jax.jit(chunk_attention, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "q_block", "ctx_q_block", "ctx_block_pages",
    "kernel"))


# kernel=False: XLA's item loop; True: the C++ kernel where it applies (float32 on one CPU
# device, tests/models/test_chunk_attention_kernel.py), else the same loop.
@pytest.mark.parametrize("kernel", [False, True])
def test_chunk_padding_finite_and_block_size_invariant(kernel):
    f = functools.partial(chunk, kernel=kernel)
    C = 8
    q, k, v, pages, table = _chunk_inputs(13, C)
    # Row 3 at positions 6..9 after 6 context positions, row 5 at 4..5 after 4, two padding.
    tok_seq = jnp.asarray([3, 3, 3, 3, 5, 5, -1, -1], jnp.int32)
    tok_pos = jnp.asarray([6, 7, 8, 9, 4, 5, 0, 0], jnp.int32)
    opts = dict(sm_scale=SCALE, sliding_window=None, soft_cap=1.5)
    outs = [np.asarray(f(q, k, v, tok_seq, tok_pos, pages, table, q_block=qb,
                         ctx_q_block=cqb, ctx_block_pages=bp, **opts))
            for qb, cqb, bp in ((8, 8, 8), (2, 1, 1), (3, 3, 2), (128, 64, None))]
    for out in outs:
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, outs[0], rtol=1e-6, atol=1e-6)
    ref = chunk_reference(q, k, v, tok_seq, tok_pos, pages, table, soft_cap=1.5)
    np.testing.assert_allclose(outs[0][:6], ref[:6], rtol=1e-5, atol=1e-5)
    # Row 3 starting at position 0 (no context): row 5 is unchanged, row 3 is not.
    fresh = tok_pos.at[:4].set(jnp.arange(4))
    none = np.asarray(f(q, k, v, tok_seq, fresh, pages, table, q_block=2, ctx_q_block=1,
                        ctx_block_pages=1, **opts))
    assert np.isfinite(none).all()
    np.testing.assert_allclose(none[4:6], outs[0][4:6], rtol=1e-6, atol=1e-6)
    assert not np.allclose(none[:4], outs[0][:4])


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_chunk_piece_same_alone_and_beside_pieces_with_context(window, kernel):
    # Pieces (row, first position, length), rows in any order, three with context; padding.
    pieces = [(2, 10, 7), (0, 3, 6), (5, 0, 5), (1, 20, 3), (6, 1, 1)]
    C = 26
    q, k, v, pages, table = _chunk_inputs(15, C)
    rows = np.concatenate([[r] * n for r, _, n in pieces] + [[-1] * 4]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in pieces] + [[0] * 4]).astype(np.int32)
    opts = dict(sm_scale=SCALE, sliding_window=window, soft_cap=None)
    ref = chunk_reference(q, k, v, rows, pos, pages, table, window=window)
    for qb, cqb, bp in ((128, 64, None), (4, 2, 1), (5, 3, 2), (8, 16, 3)):
        f = functools.partial(chunk, q_block=qb, ctx_q_block=cqb, ctx_block_pages=bp,
                              kernel=kernel, **opts)
        full = np.asarray(f(q, k, v, jnp.asarray(rows), jnp.asarray(pos), pages, table))
        assert np.isfinite(full).all()
        np.testing.assert_allclose(full[:-4], ref[:-4], rtol=1e-5, atol=1e-5)
        at = 0
        for r, p, n in pieces:
            # The piece alone, moved to the chunk's start, the rest padding (same C: no
            # recompile for another layout).
            sel = np.arange(at, at + n)
            perm = np.concatenate([sel, np.setdiff1d(np.arange(C), sel)])
            alone_rows = np.where(np.arange(C) < n, r, -1).astype(np.int32)
            alone_pos = np.where(np.arange(C) < n, np.arange(p, p + C), 0).astype(np.int32)
            alone = np.asarray(f(q[perm], k[perm], v[perm], jnp.asarray(alone_rows),
                                 jnp.asarray(alone_pos), pages, table))
            np.testing.assert_allclose(alone[:n], full[sel], rtol=1e-6, atol=1e-6)
            at += n


def test_write_kv_round_trip_and_null_page():
    rng = np.random.default_rng(14)
    pages = jnp.asarray(rng.standard_normal((N, PS, 2 * K, D)), jnp.float32)
    table = rng.permutation(np.arange(1, N))[:PPS].astype(np.int32)
    positions = np.asarray([0, 1, 5, 6, 7, 30, 31])
    slots = table[positions // PS] * PS + positions % PS
    # Three padding tokens, all at slots of page 0 (two at the same slot).
    slots = jnp.asarray(np.concatenate([slots, [0, 0, 3]]), jnp.int32)
    T = slots.shape[0]
    k = jnp.asarray(rng.standard_normal((T, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, K, D)), jnp.float32)
    new = np.asarray(jax.jit(write_kv)(pages, k, v, slots))
    seq = new[table].reshape(MAX_LEN, 2 * K, D)  # read back through the page table
    n = len(positions)
    np.testing.assert_array_equal(seq[positions, 0::2], np.asarray(k)[:n])
    np.testing.assert_array_equal(seq[positions, 1::2], np.asarray(v)[:n])
    # Everything but the written slots (and page 0) is untouched.
    expect = np.asarray(pages).reshape(N * PS, 2 * K, D).copy()
    expect[np.asarray(slots)[:n]] = new.reshape(N * PS, 2 * K, D)[np.asarray(slots)[:n]]
    np.testing.assert_array_equal(new.reshape(N * PS, 2 * K, D)[PS:], expect[PS:])


def test_write_kv_casts_to_pages_dtype():
    pages = jnp.zeros((3, PS, 2 * K, D), jnp.bfloat16)
    k = jnp.ones((1, K, D), jnp.float32)
    new = write_kv(pages, k, 2 * k, jnp.asarray([PS + 1], jnp.int32))
    assert new.dtype == jnp.bfloat16
    assert (np.asarray(new[1, 1, 0::2], np.float32) == 1).all()
    assert (np.asarray(new[1, 1, 1::2], np.float32) == 2).all()


def test_use_tpu_kernel_false_on_cpu():
    assert jax.default_backend() == "cpu"
    assert use_tpu_kernel() is False


@pytest.mark.accelerator
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("decode", [[7, 0, 13], []])
def test_a_steps_kernel_layout_gives_the_reference_what_the_xla_tiers_compute(decode,
                                                                            sliding_window):
    """`kernel_layout` (what a step hands the TPU kernel) read by JAX's reference gives the
    XLA tiers' output for every live token: decode rows (one idle), a continuing piece after
    its context, two fresh prompts in one chunk, and padding."""
    from metrale_jax.models.ragged import kernel_layout
    rng = np.random.default_rng(21)
    B = S
    table = np.zeros((B, PPS), np.int32)
    free = list(rng.permutation(np.arange(1, N)))
    for b in range(B):
        table[b] = [free.pop() for _ in range(PPS)]
    n = len(decode)
    dec_lens = np.asarray(decode, np.int32)
    # Row 4 continues after 9 positions (tokens 9..14), rows 5 and 6 start (3 and 2 tokens).
    rows = [4] * 6 + [5] * 3 + [6] * 2 + [-1] * 5
    pos = list(range(9, 15)) + [0, 1, 2] + [0, 1] + [0] * 5
    C = len(rows)
    chunk_rows, chunk_pos = np.asarray(rows, np.int32), np.asarray(pos, np.int32)
    pages = rng.standard_normal((N, PS, 2 * K, D)).astype(np.float32)
    pages[0] = 0.0
    q = jnp.asarray(rng.standard_normal((n + C, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((C, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((C, K, D)), jnp.float32)
    real = chunk_rows >= 0
    slots = np.where(real, table[np.maximum(chunk_rows, 0), chunk_pos // PS] * PS
                     + chunk_pos % PS, chunk_pos % PS)
    pool = write_kv(jnp.asarray(pages), k, v, jnp.asarray(slots, jnp.int32))
    opts = dict(sm_scale=SCALE, sliding_window=sliding_window, soft_cap=None)

    ours = [np.asarray(chunk_attention(q[n:], k, v, jnp.asarray(chunk_rows),
                                       jnp.asarray(chunk_pos), pool, jnp.asarray(table),
                                       **opts))]
    if n:
        ours.insert(0, np.asarray(decode_attention(q[:n], pool, jnp.asarray(table[:n]),
                                                   jnp.asarray(dec_lens), **opts)))
    ours = np.concatenate(ours)
    kl = kernel_layout(jnp.asarray(table), jnp.asarray(dec_lens), jnp.asarray(chunk_rows),
                       jnp.asarray(chunk_pos))
    assert int(kl.num_seqs[0]) == n + 3
    live = np.concatenate([dec_lens > 0, real])
    ref = np.asarray(ref_ragged_paged_attention(q, pool, kl.kv_lens, kl.page_indices,
                                                kl.cu_q_lens, kl.num_seqs, **opts))
    assert ref.shape[0] == n + int(real.sum())  # the reference returns the real tokens only
    np.testing.assert_allclose(ref[live[:ref.shape[0]]], ours[live], rtol=2e-5, atol=2e-5)
    # The kernel contract's XLA path (what `ragged_paged_attention` runs off TPU) agrees.
    via = np.asarray(rpa(q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs,
                         num_decode=n, **opts))
    np.testing.assert_allclose(via[live], ours[live], rtol=2e-5, atol=2e-5)


def test_kernel_layout_of_a_decode_only_step():
    from metrale_jax.models.ragged import kernel_layout
    table = jnp.arange(1, 1 + 3 * PPS, dtype=jnp.int32).reshape(3, PPS)
    kl = kernel_layout(table, jnp.asarray([5, 0, 9], jnp.int32), jnp.zeros((0,), jnp.int32),
                       jnp.zeros((0,), jnp.int32))
    assert kl.kv_lens.tolist() == [5, 1, 9]  # an idle row reads one position, ignored
    assert kl.cu_q_lens.tolist() == [0, 1, 2, 3] and kl.num_seqs.tolist() == [3]
    assert np.array_equal(kl.page_indices, table)
