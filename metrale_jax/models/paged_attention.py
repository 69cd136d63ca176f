"""Paged attention: the KV cache as a pool of fixed-size pages, and attention that reads it.

Layout (that of JAX's TPU kernel `jax.experimental.pallas.ops.tpu.ragged_paged_attention`): per
layer a pool `pages: [N, ps, 2K, D]` of N pages of ps positions each, keys and values interleaved
on axis 2 (key head j at index 2j, value head j at 2j+1). A sequence owns a page table row
`table: [PPS] int32`; its position p lives at page `table[p // ps]`, offset `p % ps`, i.e. at the
flat slot `table[p // ps] * ps + p % ps` of the pool seen as `[N*ps, 2K, D]`.

Page 0 is the null page: it is never allocated to a sequence. Padding tokens write their keys and
values there, and unused page table entries may point there, so its content is garbage: every
read of it is masked out.

On TPU, `ragged_paged_attention` calls the Pallas kernel (`models/accelerator_attention.py`: its
preconditions, checked before the call, and its `shard_map` over kv heads under a mesh; a model
that does not fit it, head_dim 64 or K = 3 for one, runs the XLA path there too). Elsewhere
(CPU, GPU: `docs/attention-kernels.md` says why no JAX GPU kernel fits) it runs an XLA path in
two tiers, because one gather per query token of its whole context would cost a long prefill
chunk `C * span` page reads:

- decode rows (one query each) read their own pages (`decode_attention`);
- the prefill chunk attends to itself (its fresh keys and values, masked by sequence and
  position) plus, for each of its pieces (a prompt's run of tokens), that sequence's earlier
  context read from its pages; any number of pieces may have context (`chunk_attention`).

On a single float32 CPU device both tiers are C++ kernels (`metrale_jax/kernels/`:
`decode_attention`, `chunk_attention`); a mesh keeps XLA's loops. Both loop over blocks of
pages with an online softmax (flash attention's recurrence), the trip
counts traced from the lengths: a step costs what its sequences hold, not what the page table
could hold, nothing recompiles for another layout of the step, and no gathered block or score
matrix outgrows the CPU's cache.

Dimension letters: T tokens, H query heads, K kv heads, G = H // K query heads per kv head, D
head dim, N pages, ps page size, PPS pages per sequence, n rows, C chunk tokens.
Softmax statistics are float32; results are in q's dtype.

An int8 pool (`models/kv_quant.py`) is `[N, ps, 2K, D + 4]` int8: every row carries its float32
scale in its last 4 bytes. `write_kv` quantizes what it writes; every read dequantizes the rows
it gathers (the CPU kernel reads them in place), so the arithmetic is float32 as for a float
pool. The TPU kernel takes float pools only: an int8 pool runs the XLA path there too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.kernels import chunk_attention as cpu_chunk_kernel
from metrale_jax.kernels import decode_attention as cpu_kernel
from metrale_jax.models.accelerator_attention import (
    fits_tpu_kernel,
    kernel_mesh,
    tpu_ragged_paged_attention,
    use_tpu_kernel,
)
from metrale_jax.models.kv_quant import dequantize_rows, is_quantized, quantize_rows

__all__ = [
    "chunk_attention",
    "chunk_kernel_applies",
    "decode_attention",
    "decode_block_pages",
    "decode_kernel_applies",
    "ragged_paged_attention",
    "use_tpu_kernel",
    "write_kv",
]


def write_kv(pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes keys and values into the page pool at flat slots.

    pages: `[N, ps, 2K, D]` (int8: `[N, ps, 2K, D + 4]`, each row quantized with its scale,
    `models/kv_quant.py`); k, v: `[T, K, D]`; slots: `[T] int32`, flat slots
    `page * ps + offset` (padding tokens go to slots of page 0, the only place duplicates may
    occur). Returns the pool in pages' dtype, with key head j of token t at `[slot_t, 2j]` and
    its value head at `[slot_t, 2j + 1]`.
    """
    ps, K2 = pages.shape[1], pages.shape[2]
    T, _, D = k.shape
    # [T, K, 2, D] -> [T, 2K, D]: key head j at 2j, value head j at 2j + 1.
    update = jnp.stack([k, v], axis=2).reshape(T, K2, D)
    update = quantize_rows(update) if is_quantized(pages.dtype) else update.astype(pages.dtype)
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


def decode_kernel_applies(dtype, pages_dtype=None) -> bool:
    """Whether `decode_attention` runs the C++ kernel (`kernels/decode_attention.py`) for
    queries of `dtype` and pages of `pages_dtype` (None: `dtype`): float32 queries over float32
    or int8 pages, on a single-device CPU backend (a mesh keeps the XLA loop, which its SPMD
    partitioner can split), with the kernel enabled and built."""
    pages_dtype = dtype if pages_dtype is None else pages_dtype
    if dtype != jnp.float32 or not (pages_dtype == dtype or is_quantized(pages_dtype)):
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    return cpu_kernel.available()


def chunk_kernel_applies(dtype, pages_dtype=None) -> bool:
    """Whether `chunk_attention` runs the C++ kernel (`kernels/chunk_attention.py`): the
    conditions of `decode_kernel_applies` (float32 queries over float32 or int8 pages, a
    single-device CPU backend: a mesh keeps XLA's loops, which its SPMD partitioner can
    split), with that kernel enabled and built."""
    pages_dtype = dtype if pages_dtype is None else pages_dtype
    if dtype != jnp.float32 or not (pages_dtype == dtype or is_quantized(pages_dtype)):
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    return cpu_chunk_kernel.available()


def decode_attention(q: jax.Array, pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                     *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                     block_pages: int | None = None, kernel: bool = True) -> jax.Array:
    """Attention of one query per row to its sequence's cached keys.

    On a single-device CPU backend in float32 (and `kernel`), a C++ kernel computes it
    (`metrale_jax/kernels/decode_attention.py`: each row's pages read in place, an online
    softmax page by page); otherwise the XLA loop below.

    q: `[n, H, D]`, the query of row r at position `kv_lens[r] - 1` (its own key and value
    already written); pages: `[N, ps, 2K, D]`; page_table: `[n, PPS] int32`; kv_lens: `[n] int32`
    (0 for an idle row, whose output is 0). Query head h reads kv head `h // G`.

    A loop over blocks of `block_pages` pages (default `decode_block_pages(ps)`) with an online
    softmax, as many blocks as the longest row needs (a traced trip count): a step costs what
    its rows hold, and each block's gathered keys stay in cache while both products read
    them. (Gathering a whole span first and then multiplying costs several times more on
    XLA:CPU once it outgrows the cache: bench/paged.py.) Blocks past a row's length add exact
    zeros, so a row's result does not depend on the others in the batch.

    On XLA:CPU the cost is each block's work (its gather and small products, about 20 to 40
    µs per row and 64-position block at the default model's shape), not the loop's trip
    count: unrolling 4 or 8 blocks per iteration (same arithmetic) and blocks of 128 to 512
    positions were all slower or no faster, at 1 and 16 rows (bench/decode_attention.py).

    Key position kp is visible when `kp < kv_len` and, with a sliding window w,
    `kv_len - 1 - kp < w` (blocks wholly before every row's window are skipped). Scores:
    `s * sm_scale`, then `soft_cap * tanh(s / soft_cap)`. Returns `[n, H, D]` in q's dtype.
    """
    if kernel and decode_kernel_applies(q.dtype, pages.dtype):
        return cpu_kernel.decode_attention(q, pages, page_table, kv_lens, sm_scale=sm_scale,
                                           sliding_window=sliding_window, soft_cap=soft_cap)
    n, H, D = q.shape
    _, ps, K2, Dp = pages.shape
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
        kv = pages[idx].reshape(n, span, K, 2, Dp)
        if is_quantized(pages.dtype):
            kv = dequantize_rows(kv, q.dtype)
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
                    tok_pos: jax.Array, pages: jax.Array, page_table: jax.Array, *,
                    sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                    q_block: int = 128, ctx_q_block: int = 32,
                    ctx_block_pages: int | None = None, kernel: bool = True) -> jax.Array:
    """Attention of a prefill chunk: each token to its own piece's chunk tokens and context.

    q: `[C, H, D]`; k, v: `[C, K, D]`, the chunk's own (fresh) keys and values (also already
    in pages); tok_seq: `[C] int32`, each token's row of page_table: `[S, PPS] int32` (padding
    tokens: -1, all after the real ones; their output is finite but meaningless); tok_pos:
    `[C] int32`, each token's position in its sequence; pages: `[N, ps, 2K, D]`.

    A piece is a maximal run of consecutive real tokens with the same row and consecutive
    positions (a row has at most one piece per chunk). A piece whose first token is at
    position p0 has its row's context, positions `0 .. p0 - 1`, in the pages through
    `page_table[row]` (p0 = 0: no context); any number of pieces may have context. Token t sees
    (a) chunk tokens u with `tok_seq[u] == tok_seq[t]` and `tok_pos[u] <= tok_pos[t]`, and
    (b) its piece's context positions `0 .. p0 - 1`.
    With a sliding window w, both also need `tok_pos[t] - key position < w`. Scores of (a) and
    (b) share one float32 softmax. Returns `[C, H, D]` in q's dtype.

    On a single-device CPU backend in float32 (and `kernel`; `chunk_kernel_applies`), a C++
    kernel computes it (`metrale_jax/kernels/chunk_attention.py`: per tile of up to 128 of a
    piece's queries and kv head, the visible key positions in blocks of 64, read from the
    pages or the chunk's own k, v and packed once per block, both products as register-tiled
    multiply-adds, an online softmax between them); q_block, ctx_q_block and ctx_block_pages
    do not apply there. `bench/chunk_attention.py --cases micro` (default model's shape, a
    512-token chunk, 2 loaded cores, ms per layer, XLA's loop below -> kernel): one piece
    after 0 positions 32 -> 10, after 2,000 116 -> 36, after 7,500 164 -> 127 (56 -> 72
    GFLOP/s, a plain matmul 95); 8 pieces of 64 after 800: 54 -> 16; 16 pieces of 32 after
    1,000: 46 -> 21. Padding tokens get 0 there. `kernel=False` (static) keeps the XLA path
    below, as do a mesh, bfloat16 and other backends.

    XLA path: flash-style, so that no score matrix outgrows the cache (one dense
    `[C, H, C + ctx]` score matrix cost 3 to 4 times more on XLA:CPU for a 512-token chunk):
    (a) queries in static blocks of `q_block`, each against the whole chunk at once, masked;
    (b) work items computed on the device: nothing static depends on the pieces (their number
    and lengths are data, so no layout recompiles). Each piece with context is cut into
    items of `q_block` queries, the last one partly masked when the piece's tail past whole
    `q_block`s is over `q_block // 2`, else that tail into items of `ctx_q_block` (only
    those when `ctx_q_block >= q_block`). An item is (first chunk index, row, context length,
    piece end); items start at distinct tokens, so each size has at most C. A `fori_loop`
    over each size's traced item count runs, per item, an online softmax over its row's
    context in blocks of `ctx_block_pages` pages (default about 256 positions; as many as the
    context needs, from the first block inside the window with a sliding window), queries
    outside `[item start, piece end)` masked, and merges the item's statistics into the
    chunk's per-token (max, denominator, accumulator) from (a). Masked keys and queries add
    exact zeros, so a token's result does not depend on the other pieces in the chunk.

    Each context block costs a fixed part (gather, products' setup) per item plus a part per
    query, hence two item sizes. On XLA:CPU (2 cores, H=9, K=3, D=64, ps=16, a 512-token
    chunk): one piece after 7,500 positions took 145 ms; with items of 32 queries only,
    about 1.7x that. 16 pieces of 32 tokens after 1,000 positions each: 41 ms, 32 pieces of
    16: 70 ms (with items of 128 queries only: 81 and 152 ms; with ctx_q_block 16: 54 and
    53 ms). Everything is laid out kv-head-major (`[K, C, G, .]`), the layout of the batched
    products: that halved (a)'s cost (a fresh 512-token chunk: 13 -> 7 ms) and cut the
    context loop's by about 45% (one piece after 7,500 positions: 263 -> 145 ms).
    """
    if kernel and chunk_kernel_applies(q.dtype, pages.dtype):
        return cpu_chunk_kernel.chunk_attention(
            q, k, v, tok_seq, tok_pos, pages, page_table, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap).astype(q.dtype)
    C, H, D = q.shape
    _, ps, K2, _ = pages.shape
    K = K2 // 2
    G = H // K
    bp = ctx_block_pages or decode_block_pages(ps, 256)
    span = bp * ps
    tok_seq = tok_seq.astype(jnp.int32)
    tok_pos = tok_pos.astype(jnp.int32)
    neg = jnp.finfo(jnp.float32).min
    qk = q.reshape(C, K, G, D).transpose(1, 0, 2, 3)  # [K, C, G, D]

    # (a) Static query blocks against the whole chunk: [K, c, G, C] scores each.
    ms, denoms, accs = [], [], []
    for i in range(0, C, q_block):
        qi, seq_i, pos_i = qk[:, i:i + q_block], tok_seq[i:i + q_block], tok_pos[i:i + q_block]
        s = jnp.einsum("kcgd,ukd->kcgu", qi, k, preferred_element_type=jnp.float32)
        s = _scores(s, sm_scale, soft_cap)
        dpos = pos_i[:, None] - tok_pos[None, :]  # query minus key position
        valid = (seq_i[:, None] == tok_seq[None, :]) & (dpos >= 0)
        if sliding_window is not None:
            valid &= dpos < sliding_window
        valid = valid[None, :, None, :]
        m = jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True)
        w = jnp.where(valid, jnp.exp(s - m), 0.0)
        ms.append(m)
        denoms.append(jnp.sum(w, axis=-1, keepdims=True))
        accs.append(jnp.einsum("kcgu,ukd->kcgd", w.astype(v.dtype), v,
                               preferred_element_type=jnp.float32))

    # (b) The pieces, and their items in one or two tiers of static sizes.
    t = jnp.arange(C, dtype=jnp.int32)
    real = tok_seq >= 0
    prev_seq = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tok_seq[:-1]])
    prev_pos = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tok_pos[:-1]])
    first = real & ((t == 0) | (tok_seq != prev_seq) | (tok_pos != prev_pos + 1))
    piece0 = jax.lax.cummax(jnp.where(first, t, 0))  # each token's piece's first index
    ctx = tok_pos[piece0]  # its piece's context length (p0)
    # The first piece boundary (or padding) after each token: its piece's end.
    bound = jax.lax.cummin(jnp.where(first | ~real, t, C), reverse=True)
    piece_end = jnp.concatenate([bound[1:], jnp.full((1,), C, jnp.int32)])
    off = t - piece0  # index in its piece
    with_ctx = real & (ctx > 0)
    cq, qb = max(1, min(ctx_q_block, C)), min(q_block, C)
    if qb > cq:
        # The piece's queries in items of qb: all but a tail of at most qb // 2 queries.
        n_big = jnp.minimum((piece_end - piece0 + qb // 2) // qb * qb, piece_end - piece0)
        tiers = [(qb, with_ctx & (off < n_big) & (off % qb == 0)),
                 (cq, with_ctx & (off >= n_big) & ((off - n_big) % cq == 0))]
    else:
        tiers = [(cq, with_ctx & (off % cq == 0))]

    pad = max(size for size, _ in tiers)  # an item's slices never run off
    qp = jnp.pad(qk, ((0, 0), (0, pad), (0, 0), (0, 0)))
    posp = jnp.pad(tok_pos, (0, pad))
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, bp)))
    carry = tuple(jnp.pad(x[0] if len(x) == 1 else jnp.concatenate(x, axis=1),
                          ((0, 0), (0, pad), (0, 0), (0, 0)))
                  for x in (ms, denoms, accs))  # [K, C + pad, G, 1 | 1 | D]

    def context_block(qi, pos_i, on_i, row_table, ctx_len):
        def body(b, carry):
            m, denom, acc = carry
            idx = jax.lax.dynamic_slice_in_dim(row_table, b * bp, bp)
            kv = pages[idx].reshape(span, K, 2, pages.shape[-1])
            if is_quantized(pages.dtype):
                kv = dequantize_rows(kv, qi.dtype)
            s = jnp.einsum("kcgd,lkd->kcgl", qi, kv[:, :, 0], preferred_element_type=jnp.float32)
            s = _scores(s, sm_scale, soft_cap)
            kp = b * span + jnp.arange(span, dtype=jnp.int32)
            valid = on_i[:, None] & (kp[None, :] < ctx_len)  # [c, span]
            if sliding_window is not None:
                valid &= pos_i[:, None] - kp[None, :] < sliding_window
            valid = valid[None, :, None, :]
            m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True))
            w = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            scale = jnp.exp(m - m_new)
            out = jnp.einsum("kcgl,lkd->kcgd", w.astype(kv.dtype), kv[:, :, 1],
                             preferred_element_type=jnp.float32)
            return m_new, denom * scale + jnp.sum(w, axis=-1, keepdims=True), acc * scale + out
        return body

    def run_items(size, starts):
        def run_item(i, carry):
            m, denom, acc = carry
            s0 = starts[i]
            row, ctx_len, end = tok_seq[s0], ctx[s0], piece_end[s0]
            qi = jax.lax.dynamic_slice_in_dim(qp, s0, size, axis=1)
            pos_i = jax.lax.dynamic_slice_in_dim(posp, s0, size)
            on_i = s0 + jnp.arange(size, dtype=jnp.int32) < end  # [size] the item's queries
            start = jnp.zeros((), jnp.int32)
            if sliding_window is not None:  # the first block any of its queries sees
                start = jnp.clip(tok_pos[s0] - sliding_window + 1, 0, None) // span
            init = (jnp.full((K, size, G, 1), neg, jnp.float32),
                    jnp.zeros((K, size, G, 1), jnp.float32),
                    jnp.zeros((K, size, G, D), jnp.float32))
            mi, di, ai = jax.lax.fori_loop(
                start, (ctx_len + span - 1) // span,
                context_block(qi, pos_i, on_i, table[row], ctx_len), init)
            # Online-softmax merge into the chunk's statistics; other queries keep theirs.
            m0, d0, a0 = (jax.lax.dynamic_slice_in_dim(x, s0, size, axis=1)
                          for x in (m, denom, acc))
            m1 = jnp.maximum(m0, mi)
            f0, fi = jnp.exp(m0 - m1), jnp.exp(mi - m1)
            on = on_i[None, :, None, None]
            m1 = jnp.where(on, m1, m0)
            d1 = jnp.where(on, d0 * f0 + di * fi, d0)
            a1 = jnp.where(on, a0 * f0 + ai * fi, a0)
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, s0, axis=1)
                         for x, y in ((m, m1), (denom, d1), (acc, a1)))
        return run_item

    for size, item in tiers:
        # The tier's item starts, compacted to the front of a static [C] array.
        slot = jnp.where(item, jnp.cumsum(item, dtype=jnp.int32) - 1, C)
        starts = jnp.zeros((C,), jnp.int32).at[slot].set(t, mode="drop")
        carry = jax.lax.fori_loop(0, jnp.sum(item, dtype=jnp.int32), run_items(size, starts),
                                  carry)

    _, denom, acc = carry
    out = acc[:, :C] / jnp.where(denom[:, :C] > 0, denom[:, :C], 1.0)  # [K, C, G, D]
    return out.transpose(1, 0, 2, 3).reshape(C, H, D).astype(q.dtype)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                           *, sm_scale: float = 1.0, sliding_window: int | None = None,
                           soft_cap: float | None = None, mask_value: float | None = None,
                           num_decode: int = 0, block_pages: int | None = None,
                           q_block: int = 128, ctx_q_block: int = 32) -> jax.Array:
    """Ragged paged attention with the contract of JAX's TPU kernel of that name.

    q: `[T, H, D]`, all sequences' queries; kv_pages: `[N, ps, 2K, D]`, already holding this
    step's keys and values; kv_lens: `[S] int32`, each sequence's length including this step's
    queries; page_indices: `[S, PPS] int32`; cu_q_lens: `[S + 1] int32`, sequence i's queries are
    tokens `cu_q_lens[i] .. cu_q_lens[i+1] - 1`, its last `q_len` positions; num_seqs: `[1] int32`,
    sequences past it are ignored. Tokens from `cu_q_lens[num_seqs]` on are padding (finite,
    meaningless output). Returns `[T, H, D]` in q's dtype.

    On TPU (`use_tpu_kernel()`), where the model fits it (`accelerator_attention.
    fits_tpu_kernel`: float pool, head_dim a multiple of 128, 2K tiled; else the XLA path, the
    reason logged once), this calls the Pallas kernel (under `shard_map` over kv heads on the
    engine's mesh), which takes any batch and ignores num_decode, block_pages, q_block and
    ctx_q_block. The XLA path restricts the batch:

    - num_decode (static): the first num_decode sequences have exactly one query each (tokens
      `0 .. num_decode - 1`); decode rows past num_seqs are idle;
    - every later sequence below num_seqs is part of one prefill chunk (tokens
      `num_decode .. T - 1`); any number of them may have earlier context (`kv_len > q_len`:
      positions `0 .. kv_len - q_len - 1`, read from the pages), the others start at
      position 0.

    The chunk's own keys and values are read back from the pages at its tokens' slots; each
    chunk token's row for `chunk_attention` is its sequence's index into page_indices. Masked
    keys get weight exactly 0 (mask_value, kept for the kernel, is not used by the XLA path).
    block_pages (static): pages per block of both tiers' loops (None: their defaults);
    q_block (static): the chunk's query block; ctx_q_block (static): the chunk's query
    sub-block against its pieces' context.
    """
    if use_tpu_kernel() and fits_tpu_kernel(q, kv_pages):
        return tpu_ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
            mesh=kernel_mesh())

    del mask_value
    T = q.shape[0]
    N, ps, K2, Dp = kv_pages.shape
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
        # Each chunk token's sequence (-1 for padding), position and flat slot. A sequence's
        # first token is at position kv_len - q_len: its context length.
        t = jnp.arange(num_decode, T, dtype=jnp.int32)  # [C]
        ends_before = (cu_q_lens[None, 1:] <= t[:, None]) & live[None, :]  # [C, S]
        seq = jnp.sum(ends_before, axis=1, dtype=jnp.int32)
        real = t < cu_q_lens[n_seqs]
        seq_c = jnp.where(real, seq, 0)
        tok_seq = jnp.where(real, seq, -1)
        tok_pos = jnp.where(real, kv_lens[seq_c] - (cu_q_lens[seq_c + 1] - t), 0)
        page = page_indices[seq_c, jnp.clip(tok_pos // ps, 0, PPS - 1)]
        slots = jnp.where(real, page * ps + tok_pos % ps, 0)
        kv = kv_pages.reshape(N * ps, K2 // 2, 2, Dp)[slots]  # [C, K, 2, D (+ 4)]
        if is_quantized(kv_pages.dtype):
            kv = dequantize_rows(kv, q.dtype)

        outs.append(chunk_attention(
            q[num_decode:], kv[:, :, 0], kv[:, :, 1], tok_seq, tok_pos, kv_pages, page_indices,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            q_block=q_block, ctx_q_block=ctx_q_block, ctx_block_pages=block_pages))

    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
