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

- decode rows (one query each) read their own pages (`decode_attention`);
- the prefill chunk attends to itself (its fresh keys and values, masked by sequence and
  position) plus the context of at most one sequence, read from its pages (`chunk_attention`).

Both loop over blocks of pages with an online softmax (flash attention's recurrence), the trip
count traced from the lengths: a step costs what its sequences hold, not what the page table
could hold, and no gathered block or score matrix outgrows the CPU's cache.

Dimension letters: T tokens, H query heads, K kv heads, G = H // K query heads per kv head, D
head dim, N pages, ps page size, PPS pages per sequence, n rows, C chunk tokens.
Softmax statistics are float32; results are in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "chunk_attention",
    "decode_attention",
    "decode_block_pages",
    "ragged_paged_attention",
    "use_tpu_kernel",
    "write_kv",
]


def use_tpu_kernel() -> bool:
    """Whether `ragged_paged_attention` calls the Pallas TPU kernel (on TPU) or the XLA path."""
    return jax.default_backend() == "tpu"


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
                    q_block: int = 128, ctx_block_pages: int | None = None) -> jax.Array:
    """Attention of a prefill chunk: each token to its own sequence's chunk tokens and context.

    q: `[C, H, D]`; k, v: `[C, K, D]`, the chunk's own (fresh) keys and values; tok_seq:
    `[C] int32`, each token's sequence id (padding tokens: an id no real token has, e.g. -1;
    their output is finite but meaningless); tok_pos: `[C] int32`, each token's position in its
    sequence. Token t sees
    (a) chunk tokens u with `tok_seq[u] == tok_seq[t]` and `tok_pos[u] <= tok_pos[t]`, and
    (b) when `tok_seq[t] == ctx_seq`, context positions `0 .. ctx_len - 1` of that sequence,
    read from pages: `[N, ps, 2K, D]` through ctx_table: `[PPS] int32`.
    With a sliding window w, both also need `tok_pos[t] - key position < w`. Scores of (a) and
    (b) share one float32 softmax. ctx_seq, ctx_len: int32 scalars; at most one sequence has
    context (ctx_len 0 or ctx_seq -1: none).

    Flash-style, so that no score matrix outgrows the cache: queries in static blocks of
    `q_block`; each block takes (a) at once, then, if it holds a token of ctx_seq, loops over
    the context in blocks of `ctx_block_pages` pages (default about 256 positions; as many as
    ctx_len needs, a traced trip count) with an online softmax. (One dense `[C, H, C + ctx]`
    score matrix cost 3 to 4 times more on XLA:CPU for a 512-token chunk.) Returns
    `[C, H, D]` in q's dtype.
    """
    C, H, D = q.shape
    _, ps, K2, _ = pages.shape
    K = K2 // 2
    G = H // K
    bp = ctx_block_pages or decode_block_pages(ps, 256)
    span = bp * ps
    qg = q.reshape(C, K, G, D)
    tok_seq = tok_seq.astype(jnp.int32)
    tok_pos = tok_pos.astype(jnp.int32)
    ctx_seq = jnp.asarray(ctx_seq, jnp.int32)
    ctx_len = jnp.asarray(ctx_len, jnp.int32)
    table = jnp.pad(ctx_table.astype(jnp.int32), (0, bp))
    on = (tok_seq == ctx_seq) & (ctx_seq >= 0)  # [C] tokens that see the context
    blocks = jnp.where(ctx_seq >= 0, (ctx_len + span - 1) // span, 0)
    neg = jnp.finfo(jnp.float32).min

    def context_block(qi, pos_i, on_i):
        def body(b, carry):
            m, denom, acc = carry
            idx = jax.lax.dynamic_slice_in_dim(table, b * bp, bp)
            kv = pages[idx].reshape(span, K, 2, D)
            s = jnp.einsum("ckgd,lkd->ckgl", qi, kv[:, :, 0], preferred_element_type=jnp.float32)
            s = _scores(s, sm_scale, soft_cap)
            kp = b * span + jnp.arange(span, dtype=jnp.int32)
            valid = on_i[:, None] & (kp[None, :] < ctx_len)  # [c, span]
            if sliding_window is not None:
                valid &= pos_i[:, None] - kp[None, :] < sliding_window
            valid = valid[:, None, None, :]
            m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True))
            w = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            scale = jnp.exp(m - m_new)
            out = jnp.einsum("ckgl,lkd->ckgd", w.astype(kv.dtype), kv[:, :, 1],
                             preferred_element_type=jnp.float32)
            return m_new, denom * scale + jnp.sum(w, axis=-1, keepdims=True), acc * scale + out
        return body

    outs = []
    for i in range(0, C, q_block):
        qi, seq_i, pos_i = qg[i:i + q_block], tok_seq[i:i + q_block], tok_pos[i:i + q_block]
        # (a) The block's queries to the whole chunk: [c, K, G, C].
        s = jnp.einsum("ckgd,ukd->ckgu", qi, k, preferred_element_type=jnp.float32)
        s = _scores(s, sm_scale, soft_cap)
        dpos = pos_i[:, None] - tok_pos[None, :]  # query minus key position
        valid = (seq_i[:, None] == tok_seq[None, :]) & (dpos >= 0)
        if sliding_window is not None:
            valid &= dpos < sliding_window
        valid = valid[:, None, None, :]
        m = jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True)
        w = jnp.where(valid, jnp.exp(s - m), 0.0)
        acc = jnp.einsum("ckgu,ukd->ckgd", w.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        carry = (m, jnp.sum(w, axis=-1, keepdims=True), acc)
        # (b) The context, block by block; only in query blocks that hold a token of the
        # sequence with context (elsewhere every block would add exact zeros).
        on_i = on[i:i + q_block]
        _, denom, acc = jax.lax.fori_loop(0, jnp.where(jnp.any(on_i), blocks, 0),
                                          context_block(qi, pos_i, on_i), carry)
        outs.append(acc / jnp.where(denom > 0, denom, 1.0))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return out.reshape(C, H, D).astype(q.dtype)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                           *, sm_scale: float = 1.0, sliding_window: int | None = None,
                           soft_cap: float | None = None, mask_value: float | None = None,
                           num_decode: int = 0, block_pages: int | None = None,
                           q_block: int = 128) -> jax.Array:
    """Ragged paged attention with the contract of JAX's TPU kernel of that name.

    q: `[T, H, D]`, all sequences' queries; kv_pages: `[N, ps, 2K, D]`, already holding this
    step's keys and values; kv_lens: `[S] int32`, each sequence's length including this step's
    queries; page_indices: `[S, PPS] int32`; cu_q_lens: `[S + 1] int32`, sequence i's queries are
    tokens `cu_q_lens[i] .. cu_q_lens[i+1] - 1`, its last `q_len` positions; num_seqs: `[1] int32`,
    sequences past it are ignored. Tokens from `cu_q_lens[num_seqs]` on are padding (finite,
    meaningless output). Returns `[T, H, D]` in q's dtype.

    On TPU (`use_tpu_kernel()`) this calls the Pallas kernel, which takes any batch and ignores
    num_decode, block_pages and q_block. The XLA path elsewhere restricts the batch:

    - num_decode (static): the first num_decode sequences have exactly one query each (tokens
      `0 .. num_decode - 1`); decode rows past num_seqs are idle;
    - every later sequence below num_seqs is part of one prefill chunk (tokens
      `num_decode .. T - 1`), and at most ONE of them has earlier context (`kv_len > q_len`);
      the others start at position 0.

    The chunk's own keys and values are read back from the pages at its tokens' slots. Masked
    keys get weight exactly 0 (mask_value, kept for the kernel, is not used by the XLA path).
    block_pages (static): pages per block of both tiers' loops (None: their defaults);
    q_block (static): the chunk's query block.
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
    outs = []

    if num_decode:
        dec_lens = jnp.where(live[:num_decode], kv_lens[:num_decode], 0)
        outs.append(decode_attention(
            q[:num_decode], kv_pages, page_indices[:num_decode], dec_lens, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, block_pages=block_pages))

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

        outs.append(chunk_attention(
            q[num_decode:], kv[:, :, 0], kv[:, :, 1], tok_seq, tok_pos, kv_pages, ctx_table,
            ctx_seq, ctx_len, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, q_block=q_block, ctx_block_pages=block_pages))

    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
