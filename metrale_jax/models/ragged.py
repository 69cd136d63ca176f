"""One ragged step of the model over a paged KV cache: decode rows and prefill chunks together.

A step's T tokens are laid out flat, in two tiers whose sizes are static:
- tokens `0 .. n-1`: one decode token for each of the rows `0 .. n-1` (a row not decoding this
  step writes to the null page and its output is ignored);
- tokens `n .. n+C-1`: the prefill chunk, made of whole prompts and prompt pieces of any rows
  (token t belongs to row `chunk_rows[t]`, -1 for padding); a piece that starts past position
  0 has earlier context in its row's pages (a long prompt's later piece, or a prefix shared
  from the prefix cache).
Every token's key and value are written into its row's pages first; then decode rows attend to
their pages and the chunk attends to itself plus each piece's context
(`models/paged_attention.py`). Pages written in a step are read in the same step: a piece may
share a prefix that another piece of the step writes.
The projections, norms and MLP run once over all T tokens, so a prompt riding along costs
its tokens' compute and never stops the rows that decode.

Layers run unrolled over `LayerParams` (`models/unrolled.py`: one traced body per layer shape),
each layer's page pool updated in place when the caller donates it, or as a `lax.scan` over
`StackedLayerParams` and one stacked pool (`models/scanned.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.models.kv_quant import as_stored, stored_head_dim
from metrale_jax.models.layers import embed_tokens, lm_logits, rms_norm
from metrale_jax.models.lora import lora_delta
from metrale_jax.models.paged_attention import (
    chunk_attention,
    decode_attention,
    ragged_paged_attention,
    write_kv,
)
from metrale_jax.models.scanned import StackedLayerParams, layer_group, zero_pools
from metrale_jax.models.unrolled import LayerGraph, LayerParams
from metrale_jax.models.window_cache import WindowedPools, group_pools, layer_pools

# Logical axes of one layer's page pool [N, ps, 2K, D] (engine/sharding.py maps them).
PAGE_AXES: tuple[str | None, ...] = (None, None, "kv_pairs", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where each token of a ragged step reads and writes (device arrays; shapes static).

    slots: [T] int32, the flat pool slot (page * ps + offset) each token's key and value go
        to (the null page for padding and idle rows).
    dec_table: [n, PPS] int32, the decode rows' page tables; dec_lens: [n] int32, the
        positions each decode row attends to (its new token included; 0 = idle).
    chunk_rows: [C] int32, the row of each chunk token (-1 = padding).
    page_table: [B, PPS] int32, every row's pages (the chunk's pieces read their context
        through their rows).
    kernel: the same step for the TPU kernel (`kernel_layout`), on TPU only (else None).
    window: the same step in the sliding-window layers' rings, for pools that are
        `WindowedPools` (`models/window_cache.py`; else None).
    """

    slots: jax.Array
    dec_table: jax.Array
    dec_lens: jax.Array
    chunk_rows: jax.Array
    page_table: jax.Array
    kernel: KernelLayout | None = None
    window: StepLayout | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """A ragged step's sequences in the terms of JAX's TPU ragged paged attention kernel.

    Sequence i < n is decode row i (one query; an idle row reads one position, its output
    ignored); sequence n + p is the p-th prompt piece of the chunk. kv_lens: [n + C] int32;
    page_indices: [n + C, PPS] int32; cu_q_lens: [n + C + 1] int32 (sequence i's queries are
    tokens cu_q_lens[i] .. cu_q_lens[i + 1] - 1); num_seqs: [1] int32.
    """

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def kernel_layout(page_table: jax.Array, dec_lens: jax.Array, chunk_rows: jax.Array,
                  chunk_positions: jax.Array) -> KernelLayout:
    """The kernel's view of a step: page_table [B, PPS] int32 (row b's pages), dec_lens [n]
    int32 (each decode row's length, its new token included; 0 = idle), chunk_rows and
    chunk_positions [C] int32 (each chunk token's row, -1 for padding after the real
    tokens, and its position). A piece is a run of consecutive positions of one row."""
    n, C = dec_lens.shape[0], chunk_rows.shape[0]
    B = page_table.shape[0]
    i32 = jnp.int32
    if C == 0:
        return KernelLayout(jnp.maximum(dec_lens, 1).astype(i32), page_table[:n].astype(i32),
                            jnp.arange(n + 1, dtype=i32), jnp.full((1,), n, i32))
    real = chunk_rows >= 0
    n_real = jnp.sum(real, dtype=i32)
    prev_rows = jnp.concatenate([jnp.full((1,), -2, i32), chunk_rows[:-1]])
    prev_pos = jnp.concatenate([jnp.full((1,), -2, i32), chunk_positions[:-1]])
    start = real & ((chunk_rows != prev_rows) | (chunk_positions != prev_pos + 1))
    pieces = jnp.sum(start, dtype=i32)
    (starts,) = jnp.nonzero(start, size=C, fill_value=n_real)
    starts = starts.astype(i32)
    ends = jnp.concatenate([starts[1:], n_real[None]])  # piece p: tokens starts[p] .. ends[p]-1
    last = jnp.clip(ends - 1, 0, C - 1)
    piece_kv = jnp.where(jnp.arange(C) < pieces, chunk_positions[last] + 1, 0)
    piece_rows = jnp.clip(chunk_rows[jnp.clip(starts, 0, C - 1)], 0, B - 1)
    return KernelLayout(
        kv_lens=jnp.concatenate([jnp.maximum(dec_lens, 1), piece_kv]).astype(i32),
        page_indices=jnp.concatenate([page_table[:n], page_table[piece_rows]]).astype(i32),
        cu_q_lens=jnp.concatenate([jnp.arange(n + 1, dtype=i32), n + ends]),
        num_seqs=(n + pieces).reshape(1).astype(i32))


def ragged_layers(graph: LayerGraph, params: LayerParams | StackedLayerParams, pages,
                  tokens: jax.Array, positions: jax.Array, layout: StepLayout, *,
                  n: int, lora: tuple | None = None, lora_mix: jax.Array | None = None,
                  images: tuple[jax.Array, jax.Array] | None = None,
                  router_counts: bool = False):
    """The model over one ragged step's tokens, up to the final hidden states.

    tokens, positions: [T] int32 (decode tier first, then the chunk: see the module
    docstring); params and pages in one of two forms: `LayerParams` and L pools
    `[N, ps, 2K, D]` (the layers unrolled), or `StackedLayerParams` and one pool
    `[L, N, ps, 2K, D]` (a scan, `models/scanned.py`); n: static, the decode rows; lora: per
    layer the adapter slots' weights (`models/lora.py`; None: no adapters), lora_mix: [T, N]
    float32, each token's weight per adapter slot (zeros: none); images: `(rows [T] int32,
    pool [P, E])`, each token's row of the image feature pool (-1: its token embedding).
    Returns the hidden states `[T, E]` (before the final norm: `head` turns chosen rows into
    logits) and the pools, in their form, with this step's keys and values written; with
    `router_counts` (mixture-of-experts models only) also each layer's real tokens per
    expert `[L, X] int32` (`models/moe.py`).
    """
    x = embed(graph, params, tokens, images)
    if isinstance(params, StackedLayerParams):
        return _scanned_layers(graph, params, pages, x, positions, layout, n=n, lora=lora,
                               lora_mix=lora_mix, router_counts=router_counts)
    kinds = tuple(bool(s) for s in graph.cfg.layer_is_sliding)
    windowed = isinstance(pages, WindowedPools)
    pools = layer_pools(pages, kinds) if windowed else pages
    new_pages, counts = [], []
    layer_lora = lora if lora is not None else (None,) * len(pools)
    for state, sliding, pool, lw in zip(params.layers, kinds, pools, layer_lora, strict=True):
        lay = layout.window if (windowed and sliding) else layout
        x, pool, *routed = _ragged_layer(graph.block_def, state, x, positions, pool, lay, lw,
                                         lora_mix, sliding=sliding, n=n)
        new_pages.append(pool)
        counts.extend(routed)  # a mixture-of-experts layer's [X] (decoder_layer)
    pages_out = group_pools(new_pages, kinds) if windowed else tuple(new_pages)
    if router_counts:
        return x, pages_out, jnp.stack(counts)
    return x, pages_out


def layer_layout(layout: StepLayout, layer: jax.Array, num_pages: int,
                 page_size: int) -> StepLayout:
    """The step's layout for layer `layer` (int32, traced) of a stacked pool seen as
    `[L*N, ps, 2K, D]`: every page index p becomes `layer*N + p` (slots shift by `layer*N*ps`),
    so the layer's pages are read and written in place, never sliced out of the pool."""
    first = (layer * num_pages).astype(jnp.int32)
    kernel = layout.kernel
    if kernel is not None:
        kernel = dataclasses.replace(kernel, page_indices=kernel.page_indices + first)
    return dataclasses.replace(
        layout, slots=layout.slots + first * page_size, dec_table=layout.dec_table + first,
        page_table=layout.page_table + first, kernel=kernel)


def _scanned_layers(graph: LayerGraph, params: StackedLayerParams,
                    pages: jax.Array | WindowedPools,
                    x: jax.Array, positions: jax.Array, layout: StepLayout, *, n: int,
                    lora: tuple | None, lora_mix: jax.Array | None, router_counts: bool = False
                    ) -> tuple[jax.Array, ...]:
    """`ragged_layers`' scanned form: x [T, E] through a loop over groups of
    `layer_group(cfg)` layers (each group's layers unrolled in the body); pages
    `[L, N, ps, 2K, D]` carried as `[L*N, ps, 2K, D]`, each layer addressed by
    `layer_layout`. The stacked weights are indexed in the body (`[layer]`), not reshaped into
    groups nor passed as scan inputs: either makes XLA:CPU copy every stacked weight into the
    loop on each call. Per-layer LoRA weights are stacked first (the adapters are small).
    `WindowedPools`: two pools carried, the global layers' and the sliding layers' rings
    (`layout.window`), each layer addressed within its own kind's stack."""
    cfg = graph.cfg
    G = layer_group(cfg)
    sliding = [bool(s) for s in cfg.layer_is_sliding[:G]]
    stacked_lora = None if lora is None else jax.tree.map(lambda *a: jnp.stack(a), *lora)
    windowed = isinstance(pages, WindowedPools)
    # each pool: (stacked array, its layers' layout); a windowed model's sliding layers
    # (index 1) are numbered among themselves, as are its global ones (index 0)
    stacks = [(pages.full, layout), (pages.window, layout.window)] if windowed else [
        (pages, layout)]
    per_group = [sum(1 for s in sliding if not s), sum(sliding)] if windowed else [G]

    def at(tree, layer):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False),
                            tree)

    def body(i, carry):
        h, flats, counts = carry
        flats = list(flats)
        seen = [0, 0]
        for j in range(G):
            layer = i * G + j
            kind = int(windowed and sliding[j])
            index = i * per_group[kind] + seen[kind]
            seen[kind] += 1
            stack, lay = stacks[kind]
            w = None if stacked_lora is None else at(stacked_lora, layer)
            block = nnx.merge(graph.block_def, at(params.blocks, layer))
            h, flats[kind], *routed = decoder_layer(
                block, h, positions, flats[kind],
                layer_layout(lay, index, stack.shape[1], stack.shape[2]), w, lora_mix,
                sliding=sliding[j], n=n)
            if router_counts:
                counts = counts.at[layer].set(routed[0])
        return h, tuple(flats), counts

    flats = tuple(s.reshape(s.shape[0] * s.shape[1], *s.shape[2:]) for s, _ in stacks)
    counts = jnp.zeros((cfg.num_layers, cfg.num_experts), jnp.int32) if router_counts else None
    x, flats, counts = jax.lax.fori_loop(0, cfg.num_layers // G, body, (x, flats, counts))
    out = tuple(f.reshape(s.shape) for f, (s, _) in zip(flats, stacks, strict=True))
    pages_out = WindowedPools(*out) if windowed else out[0]
    return (x, pages_out, counts) if router_counts else (x, pages_out)


def embed(graph: LayerGraph, params: LayerParams, tokens: jax.Array,
          images: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Tokens `[T]` int32 -> embeddings `[T, E]` (int8 rows scaled; `images`: as
    `ragged_layers`')."""
    outer = params.outer
    scale = outer["embed_scale"][...] if "embed_scale" in outer else None
    return embed_tokens(graph.cfg, outer["embed"][...], tokens, images, scale)


def head(graph: LayerGraph, params: LayerParams, x: jax.Array) -> jax.Array:
    """Hidden states `[R, E]` -> logits `[R, V] float32` (final norm, LM head, soft-cap)."""
    cfg, outer = graph.cfg, params.outer
    x = rms_norm(x, outer["final_norm"]["weight"][...], cfg.rms_norm_eps,
                 cfg.norm_weight_offset)
    lm_head = None if cfg.tie_word_embeddings else outer["lm_head"][...]
    embed_scale = outer["embed_scale"][...] if "embed_scale" in outer else None
    head_scale = outer["lm_head_scale"][...] if "lm_head_scale" in outer else None
    return lm_logits(cfg, x, outer["embed"][...], lm_head, embed_scale, head_scale)


def sequence_logits(graph: LayerGraph, params: LayerParams, ids: list[int], *,
                    page_size: int = 16, cache_dtype=jnp.float32, chunk: int = 512,
                    pool_sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """The logits `[len(ids), V] float32` at every position of one sequence, prefilled through
    the paged path in chunks of `chunk` tokens: each chunk's keys and values go into a page
    pool of `cache_dtype` (int8: `models/kv_quant.py`) and later chunks read them back from
    there, as the engine's steps do. For quality measurements through the KV cache
    (perplexity, teacher-forced agreement); one compiled program per chunk size.
    pool_sharding: where the pools live (on a mesh: `engine.sharding.page_pool_sharding`)."""
    cfg = graph.cfg
    length = max(1, len(ids))
    pps = -(-(-(-length // chunk) * chunk) // page_size)  # pages for every padded chunk
    shape = (pps + 1, page_size, 2 * cfg.num_kv_heads,
             stored_head_dim(cfg.head_dim, cache_dtype))
    pages = zero_pools(cfg.num_layers, shape, cache_dtype,
                       stacked=isinstance(params, StackedLayerParams))
    if pool_sharding is not None:
        pages = jax.device_put(pages, pool_sharding)
    table = jnp.arange(1, pps + 1, dtype=jnp.int32)[None]  # [1, PPS]: row 0, pages 1 ..
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        real = jnp.arange(chunk) < len(piece)
        pos = jnp.where(real, start + jnp.arange(chunk, dtype=jnp.int32), 0)
        tokens = jnp.asarray(piece + [0] * (chunk - len(piece)), jnp.int32)
        layout = StepLayout(
            slots=jnp.where(real, table[0, pos // page_size] * page_size + pos % page_size, 0),
            dec_table=jnp.zeros((0, pps), jnp.int32), dec_lens=jnp.zeros((0,), jnp.int32),
            chunk_rows=jnp.where(real, 0, -1).astype(jnp.int32), page_table=table)
        logits, pages = _chunk_logits(graph, params, pages, tokens, pos, layout)
        out.append(logits[:len(piece)])
    return jnp.concatenate(out, axis=0)


@functools.partial(jax.jit, static_argnames=("graph",))
def _chunk_logits(graph: LayerGraph, params: LayerParams | StackedLayerParams, pages,
                  tokens: jax.Array, positions: jax.Array, layout: StepLayout):
    """`sequence_logits`' step: one prefill chunk (no decode rows) -> (logits [C, V], pages)."""
    x, pages = ragged_layers(graph, params, pages, tokens, positions, layout, n=0)
    return head(graph, params, x), pages


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, pool: jax.Array,
           layout: StepLayout, *, n: int, sm_scale: float, sliding_window: int | None,
           soft_cap: float | None) -> tuple[jax.Array, jax.Array]:
    """One layer's attention over a ragged step, the decoder-only models' and the
    encoder-decoders' self-attention alike: writes the step's keys and values into the pool,
    then the n decode rows attend to their pages and the chunk to itself plus its pieces'
    context (on TPU: JAX's kernel over the whole step).

    q: [T, H, D]; k, v: [T, K, D]; positions: [T] int32; pool: [N, ps, 2K, D]; n: static.
    Returns (out [T, H, D], the pool written)."""
    pool = write_kv(pool, k, v, layout.slots)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if layout.kernel is not None:
        kl = layout.kernel
        out = ragged_paged_attention(q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens,
                                     kl.num_seqs, num_decode=n, **opts)
        return out, pool
    parts = []
    if n:
        parts.append(decode_attention(q[:n], pool, layout.dec_table, layout.dec_lens, **opts))
    if q.shape[0] > n:
        # the chunk's own keys as the pool stores them (int8: quantized and read back)
        parts.append(chunk_attention(q[n:], as_stored(k[n:], pool.dtype),
                                     as_stored(v[n:], pool.dtype), layout.chunk_rows,
                                     positions[n:], pool, layout.page_table, **opts))
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)), pool


@functools.partial(jax.jit, static_argnames=("block_def", "sliding", "n"))
def _ragged_layer(block_def, state, x, positions, pool, layout: StepLayout, lora_w, lora_mix,
                  *, sliding: bool, n: int):
    """One unrolled decoder layer (its own jitted body per layer shape): `decoder_layer`."""
    return decoder_layer(nnx.merge(block_def, state), x, positions, pool, layout, lora_w,
                         lora_mix, sliding=sliding, n=n)


def decoder_layer(block, x: jax.Array, positions: jax.Array, pool: jax.Array,
                  layout: StepLayout, lora_w, lora_mix, *, sliding: bool, n: int
                  ) -> tuple[jax.Array, ...]:
    """One decoder layer (`block`: a merged `transformer.Block`) over a ragged step:
    x [T, E] -> ([T, E], the pool [N, ps, 2K, D] written, and for a mixture-of-experts layer
    its real tokens per expert [X] int32); lora_w: this layer's adapter weights (None: none),
    lora_mix: [T, N] each token's slot weights."""
    attn = block.attn
    cfg = attn.cfg
    delta = lora_delta(lora_w, lora_mix) if lora_w is not None else None
    q, k, v = attn.qkv(block.attn_norm(x)[None], positions[None], delta, sliding)
    q, k, v = q[0], k[0], v[0]  # [T, H, D], [T, K, D]
    window = cfg.sliding_window if (sliding and cfg.sliding_window) else None
    out, pool = attend(q, k, v, positions, pool, layout, n=n, sm_scale=cfg.attention_scale,
                       sliding_window=window, soft_cap=cfg.attn_logit_softcap or None)
    T, H, D = out.shape
    flat = out.astype(x.dtype).reshape(T, H * D)
    y = attn.project_out(flat)  # [T, H*D] @ [H*D, E] (int8 weights: scaled per channel)
    if delta is not None:
        y = y + delta("o_proj", flat)
    if not block.is_moe:
        return block.finish(x, y, delta), pool
    real = jnp.concatenate([layout.dec_lens > 0, layout.chunk_rows >= 0])
    x, counts = block.finish_routed(x, y, delta, real)
    return x, pool, counts


__all__ = ["PAGE_AXES", "KernelLayout", "StepLayout", "attend", "decoder_layer", "embed", "head",
           "kernel_layout", "layer_layout", "ragged_layers", "sequence_logits"]
