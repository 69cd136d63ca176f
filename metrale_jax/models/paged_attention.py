"""Paged attention: the KV cache as a pool of fixed-size pages, and attention that reads it.

Layout (that of JAX's TPU kernel `jax.experimental.pallas.ops.tpu.ragged_paged_attention`): per
layer a pool `pages: [N, ps, 2K, D]` of N pages of ps positions each, keys and values interleaved
on axis 2 (key head j at index 2j, value head j at 2j+1). A sequence owns a page table row
`table: [PPS] int32`; its position p lives at page `table[p // ps]`, offset `p % ps`, i.e. at the
flat slot `table[p // ps] * ps + p % ps` of the pool seen as `[N*ps, 2K, D]`.

Page 0 is the null page: it is never allocated to a sequence. Padding tokens write their keys and
values there, and unused page table entries may point there, so its content is garbage: every
read of it is masked out.

On TPU, `ragged_paged_attention` calls the Pallas kernel. Elsewhere (CPU, GPU) it runs an XLA
path in two tiers, because one gather per query token of its whole context would cost a long
prefill chunk `C * span` page reads:

- decode rows (one query each) gather their own pages (`decode_attention`);
- the prefill chunk attends densely to itself (its fresh keys and values, masked by sequence and
  position) plus the context of at most one sequence, read from pages once for the whole chunk
  (`chunk_attention`).

Both gather only a static span of pages, chosen at run time from a few candidates (`lengths`,
made by `attention_spans`) with `jax.lax.switch`, so a short batch does not pay for the longest
sequence the page table could hold.

Dimension letters: T tokens, H query heads, K kv heads, G = H // K query heads per kv head, D
head dim, N pages, ps page size, PPS pages per sequence, n rows, C chunk tokens, L span.
Softmax statistics are float32; results are in q's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "attention_spans",
    "chunk_attention",
    "decode_attention",
    "decode_block_pages",
    "ragged_paged_attention",
    "span_index",
    "use_tpu_kernel",
    "write_kv",
]


def use_tpu_kernel() -> bool:
    """Whether `ragged_paged_attention` calls the Pallas TPU kernel (on TPU) or the XLA path."""
    return jax.default_backend() == "tpu"


def attention_spans(max_len: int, page_size: int, min_span: int = 128) -> tuple[int, ...]:
    """The candidate attention spans for sequences of up to `max_len` positions.

    Increasing multiples of `page_size`: `s, 2s, 4s, ...` below the largest, where
    `s = max(page_size, min_span rounded up to a multiple of page_size)`, then the largest,
    `ceil(max_len / page_size) * page_size` (a page table's `PPS * ps`).
    """
    if max_len <= 0 or page_size <= 0:
        raise ValueError(f"need max_len > 0 and page_size > 0, got {max_len=}, {page_size=}")
    top = -(-max_len // page_size) * page_size
    span = max(page_size, -(-min_span // page_size) * page_size)
    spans = []
    while span < top:
        spans.append(span)
        span *= 2
    return (*spans, top)


def span_index(spans: Sequence[int], needed: jax.Array | int) -> jax.Array:
    """The index of the first span `>= needed` (traced int32 scalar); the last one if none is."""
    spans_arr = jnp.asarray(spans, jnp.int32)
    index = jnp.sum(spans_arr < jnp.asarray(needed, jnp.int32)).astype(jnp.int32)
    return jnp.minimum(index, len(spans) - 1)


def write_kv(pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes keys and values into the page pool at flat slots.

    pages: `[N, ps, 2K, D]`; k, v: `[T, K, D]`; slots: `[T] int32`, flat slots
    `page * ps + offset` (padding tokens go to slots of page 0, the only place duplicates may
    occur). Returns the pool, `[N, ps, 2K, D]` in pages' dtype, with key head j of token t at
    `[slot_t, 2j]` and its value head at `[slot_t, 2j + 1]`.
    """
    _, ps, K2, D = pages.shape
    T = k.shape[0]
    # [T, K, 2, D] -> [T, 2K, D]: key head j at 2j, value head j at 2j + 1.
    update = jnp.stack([k, v], axis=2).reshape(T, K2, D).astype(pages.dtype)
    # Indexed as [page, offset], never through the pool reshaped to [N*ps, 2K, D]: XLA:CPU
    # turns a one-token write through that reshape into a copy of the whole pool.
    return pages.at[slots // ps, slots % ps].set(update)


def _scores(s: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """Scales float32 scores and applies the soft cap `soft_cap * tanh(s / soft_cap)`."""
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _softmax_parts(parts: Sequence[tuple[jax.Array, jax.Array]]):
    """One softmax over the last axis of several score blocks, as if concatenated.

    parts: `(scores float32, valid bool)` pairs of the same shape but the last axis. Returns the
    unnormalised weights of each part (0 where invalid) and the float32 denominator `[..., 1]`,
    1 where a row has no valid key (its output is then 0, never NaN).
    """
    neg = jnp.finfo(jnp.float32).min
    m = None
    for s, valid in parts:
        part_max = jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True)
        m = part_max if m is None else jnp.maximum(m, part_max)
    weights = [jnp.where(valid, jnp.exp(s - m), 0.0) for s, valid in parts]
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    return weights, jnp.where(denom > 0, denom, 1.0)


def _gather_kv(pages: jax.Array, table: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """Keys and values of the first `length` positions through page table rows.

    pages: `[N, ps, 2K, D]`; table: `[..., PPS] int32`. Returns k, v: `[..., length, K, D]`.
    """
    _, ps, K2, D = pages.shape
    kv = pages[table[..., : length // ps]]  # [..., length/ps, ps, 2K, D]
    kv = kv.reshape(*table.shape[:-1], length, K2 // 2, 2, D)
    return kv[..., 0, :], kv[..., 1, :]


def _check_lengths(lengths: Sequence[int], ps: int, pps: int) -> None:
    if not lengths or any(length % ps or not 0 <= length <= pps * ps for length in lengths):
        raise ValueError(f"lengths must be multiples of page size {ps} in 0 .. {pps * ps}, "
                         f"got {lengths}")


def decode_block_pages(page_size: int, block: int = 64) -> int:
    """Pages per block of `decode_attention`'s loop: about `block` positions, at least 1 page."""
    return max(1, block // page_size)


def decode_attention(q: jax.Array, pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                     *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                     block_pages: int | None = None) -> jax.Array:
    """Attention of one query per row to its sequence's cached keys.

    q: `[n, H, D]`, the query of row r at position `kv_lens[r] - 1` (its own key and value
    already written); pages: `[N, ps, 2K, D]`; page_table: `[n, PPS] int32`; kv_lens: `[n] int32`
    (0 for an idle row, whose output is 0). Query head h reads kv head `h // G`.

    A loop over blocks of `block_pages` pages (default `decode_block_pages(ps)`) with an online
    softmax, as many blocks as the longest row needs (a traced trip count): a step costs what
    its rows hold, and each block's gathered keys stay in cache while both products read
    them. (Gathering a whole span first and then multiplying costs several times more on
    XLA:CPU once it outgrows the cache: bench/paged.py.) Blocks past a row's length add exact
    zeros, so a row's result does not depend on the others in the batch.

    Key position kp is visible when `kp < kv_len` and, with a sliding window w,
    `kv_len - 1 - kp < w` (blocks wholly before every row's window are skipped). Scores:
    `s * sm_scale`, then `soft_cap * tanh(s / soft_cap)`. Returns `[n, H, D]` in q's dtype.
    """
    n, H, D = q.shape
    _, ps, K2, _ = pages.shape
    K = K2 // 2
    G = H // K
    bp = block_pages or decode_block_pages(ps)
    span = bp * ps
    kv_lens = kv_lens.astype(jnp.int32)
    qg = q.reshape(n, K, G, D)
    # bp null columns past the end: a block's dynamic slice never runs off the table.
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, bp)))
    stop = (jnp.max(kv_lens) + span - 1) // span
    start = jnp.zeros((), jnp.int32)
    if sliding_window is not None:
        first = jnp.min(jnp.where(kv_lens > 0, kv_lens - sliding_window, jnp.int32(2**30)))
        start = jnp.clip(first, 0, None) // span
    neg = jnp.finfo(jnp.float32).min

    def block(b, carry):
        m, denom, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(table, b * bp, bp, axis=1)  # [n, bp]
        kv = pages[idx].reshape(n, span, K, 2, D)
        k, v = kv[..., 0, :], kv[..., 1, :]
        s = jnp.einsum("nkgd,nlkd->nkgl", qg, k, preferred_element_type=jnp.float32)
        s = _scores(s, sm_scale, soft_cap)
        kp = b * span + jnp.arange(span, dtype=jnp.int32)[None, :]
        valid = kp < kv_lens[:, None]  # [n, span]
        if sliding_window is not None:
            valid &= (kv_lens[:, None] - 1) - kp < sliding_window
        valid = valid[:, None, None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True))
        w = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        scale = jnp.exp(m - m_new)
        out = jnp.einsum("nkgl,nlkd->nkgd", w.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        return m_new, denom * scale + jnp.sum(w, axis=-1, keepdims=True), acc * scale + out

    init = (jnp.full((n, K, G, 1), neg, jnp.float32), jnp.zeros((n, K, G, 1), jnp.float32),
            jnp.zeros((n, K, G, D), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(start, stop, block, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(n, H, D).astype(q.dtype)


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, tok_seq: jax.Array,
                    tok_pos: jax.Array, pages: jax.Array, ctx_table: jax.Array,
                    ctx_seq: jax.Array, ctx_len: jax.Array, *, sm_scale: float,
                    sliding_window: int | None, soft_cap: float | None,
                    lengths: Sequence[int], length_index: jax.Array) -> jax.Array:
    """Attention of a prefill chunk: each token to its own sequence's chunk tokens and context.

    q: `[C, H, D]`; k, v: `[C, K, D]`, the chunk's own (fresh) keys and values; tok_seq:
    `[C] int32`, each token's sequence id (padding tokens: an id no real token has, e.g. -1;
    their output is finite but meaningless); tok_pos: `[C] int32`, each token's position in its
    sequence. Token t sees
    (a) chunk tokens u with `tok_seq[u] == tok_seq[t]` and `tok_pos[u] <= tok_pos[t]`, and
    (b) when `tok_seq[t] == ctx_seq`, context positions `0 .. ctx_len - 1` of that sequence,
    read from pages: `[N, ps, 2K, D]` through ctx_table: `[PPS] int32`.
    With a sliding window w, both also need `tok_pos[t] - key position < w`. Scores of (a) and
    (b) share one float32 softmax.

    ctx_seq, ctx_len: int32 scalars; at most one sequence has context (ctx_len 0 or ctx_seq -1:
    none). lengths: static increasing multiples of ps, the context spans one `lax.switch` branch
    each gathers; convention: `lengths[0]` may be 0, a branch that reads no context at all
    (`(0, *attention_spans(PPS * ps, ps))`). length_index: traced int32 scalar; the caller
    guarantees `lengths[length_index] >= ctx_len` (0 only when there is no context).
    Returns `[C, H, D]` in q's dtype.
    """
    C, H, D = q.shape
    _, ps, K2, _ = pages.shape
    K = K2 // 2
    G = H // K
    _check_lengths(lengths, ps, ctx_table.shape[0])
    qg = q.reshape(C, K, G, D)
    tok_seq = tok_seq.astype(jnp.int32)
    tok_pos = tok_pos.astype(jnp.int32)

    # (a) The chunk to itself: [C, K, G, C].
    s_self = jnp.einsum("ckgd,ukd->ckgu", qg, k, preferred_element_type=jnp.float32)
    s_self = _scores(s_self, sm_scale, soft_cap)
    dpos = tok_pos[:, None] - tok_pos[None, :]  # query minus key position
    valid_self = (tok_seq[:, None] == tok_seq[None, :]) & (dpos >= 0)
    if sliding_window is not None:
        valid_self &= dpos < sliding_window
    valid_self = valid_self[:, None, None, :]

    def finish(parts, values):
        weights, denom = _softmax_parts(parts)
        out = sum(jnp.einsum("ckgx,xkd->ckgd", w.astype(val.dtype), val,
                             preferred_element_type=jnp.float32)
                  for w, val in zip(weights, values, strict=True))
        return (out / denom).reshape(C, H, D).astype(q.dtype)

    def branch(length: int):
        def attend(qg, pages, ctx_table, ctx_seq, ctx_len):
            if length == 0:
                return finish([(s_self, valid_self)], [v])
            # (b) The context of sequence ctx_seq: [C, K, G, L].
            k_ctx, v_ctx = _gather_kv(pages, ctx_table, length)  # [L, K, D]
            s_ctx = jnp.einsum("ckgd,lkd->ckgl", qg, k_ctx, preferred_element_type=jnp.float32)
            s_ctx = _scores(s_ctx, sm_scale, soft_cap)
            kp = jnp.arange(length, dtype=jnp.int32)[None, :]
            on = (tok_seq == ctx_seq) & (ctx_seq >= 0)
            valid_ctx = on[:, None] & (kp < ctx_len)  # [C, L]
            if sliding_window is not None:
                valid_ctx &= tok_pos[:, None] - kp < sliding_window
            return finish([(s_self, valid_self), (s_ctx, valid_ctx[:, None, None, :])],
                          [v, v_ctx])

        return attend

    branches = [branch(length) for length in lengths]
    return jax.lax.switch(length_index, branches, qg, pages, ctx_table,
                          jnp.asarray(ctx_seq, jnp.int32), jnp.asarray(ctx_len, jnp.int32))


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                           *, sm_scale: float = 1.0, sliding_window: int | None = None,
                           soft_cap: float | None = None, mask_value: float | None = None,
                           num_decode: int = 0, min_span: int = 128) -> jax.Array:
    """Ragged paged attention with the contract of JAX's TPU kernel of that name.

    q: `[T, H, D]`, all sequences' queries; kv_pages: `[N, ps, 2K, D]`, already holding this
    step's keys and values; kv_lens: `[S] int32`, each sequence's length including this step's
    queries; page_indices: `[S, PPS] int32`; cu_q_lens: `[S + 1] int32`, sequence i's queries are
    tokens `cu_q_lens[i] .. cu_q_lens[i+1] - 1`, its last `q_len` positions; num_seqs: `[1] int32`,
    sequences past it are ignored. Tokens from `cu_q_lens[num_seqs]` on are padding (finite,
    meaningless output). Returns `[T, H, D]` in q's dtype.

    On TPU (`use_tpu_kernel()`) this calls the Pallas kernel, which takes any batch and ignores
    num_decode and min_span. The XLA path elsewhere restricts the batch:

    - num_decode (static): the first num_decode sequences have exactly one query each (tokens
      `0 .. num_decode - 1`); decode rows past num_seqs are idle;
    - every later sequence below num_seqs is part of one prefill chunk (tokens
      `num_decode .. T - 1`), and at most ONE of them has earlier context (`kv_len > q_len`);
      the others start at position 0.

    The chunk's own keys and values are read back from the pages at its tokens' slots. Masked
    keys get weight exactly 0 (mask_value, kept for the kernel, is not used by the XLA path).
    min_span (static): the smallest attention span, see `attention_spans`.
    """
    if use_tpu_kernel():
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention as tpu_ragged_paged_attention,
        )

        return tpu_ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value)

    del mask_value
    T, _, D = q.shape
    N, ps, K2, _ = kv_pages.shape
    S, PPS = page_indices.shape
    if not 0 <= num_decode <= min(T, S):
        raise ValueError(f"num_decode={num_decode} must be in 0 .. min(T={T}, S={S})")
    kv_lens = kv_lens.astype(jnp.int32)
    page_indices = page_indices.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    n_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
    live = jnp.arange(S, dtype=jnp.int32) < n_seqs  # [S]
    spans = attention_spans(PPS * ps, ps, min_span)
    outs = []

    if num_decode:
        dec_lens = jnp.where(live[:num_decode], kv_lens[:num_decode], 0)
        outs.append(decode_attention(
            q[:num_decode], kv_pages, page_indices[:num_decode], dec_lens, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap))

    C = T - num_decode
    if C:
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
        # The one prefill sequence with context, if any.
        seq_ids = jnp.arange(S, dtype=jnp.int32)
        has_ctx = live & (seq_ids >= num_decode) & (kv_lens > q_lens)
        any_ctx = jnp.any(has_ctx)
        ctx_seq = jnp.where(any_ctx, jnp.argmax(has_ctx).astype(jnp.int32), -1)
        ctx_len = jnp.where(any_ctx, kv_lens[ctx_seq] - q_lens[ctx_seq], 0)
        ctx_table = page_indices[jnp.maximum(ctx_seq, 0)]

        # Each chunk token's sequence (-1 for padding), position and flat slot.
        t = jnp.arange(num_decode, T, dtype=jnp.int32)  # [C]
        ends_before = (cu_q_lens[None, 1:] <= t[:, None]) & live[None, :]  # [C, S]
        seq = jnp.sum(ends_before, axis=1, dtype=jnp.int32)
        real = t < cu_q_lens[n_seqs]
        seq_c = jnp.where(real, seq, 0)
        tok_seq = jnp.where(real, seq, -1)
        tok_pos = jnp.where(real, kv_lens[seq_c] - (cu_q_lens[seq_c + 1] - t), 0)
        page = page_indices[seq_c, jnp.clip(tok_pos // ps, 0, PPS - 1)]
        slots = jnp.where(real, page * ps + tok_pos % ps, 0)
        kv = kv_pages.reshape(N * ps, K2 // 2, 2, D)[slots]  # [C, K, 2, D]

        ctx_lengths = (0, *spans)
        ctx_index = jnp.where(ctx_len > 0, 1 + span_index(spans, ctx_len), 0)
        outs.append(chunk_attention(
            q[num_decode:], kv[:, :, 0], kv[:, :, 1], tok_seq, tok_pos, kv_pages, ctx_table,
            ctx_seq, ctx_len, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, lengths=ctx_lengths, length_index=ctx_index))

    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
