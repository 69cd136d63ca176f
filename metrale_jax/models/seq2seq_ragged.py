"""The M2M100 / NLLB encoder-decoder in the engine's ragged paged steps.

The decoder runs in the same ragged steps as a decoder-only model (`models/ragged.py`): its
self-attention keys and values live in the paged pools, decode rows and prefill pieces mix in
one step, and beam rows fork pages. What it adds is a cross-attention read per token: each row
holds its source's cross-attention keys and values (`CrossCache`, one buffer per decoder layer
`[B, S, H, D]` with the source length per row), written once per request by the encoder
program (`encode_sources`) when the row is admitted, and read by every decoder token of the
row. Decode rows read their own rows' buffers; a prefill chunk token reads its row's
(`token_rows`), gathered per token (the decoder prompt of a translation is two tokens, so
chunks stay small).

Params: `LayerParams` whose `outer` is the `M2M100` state without `decoder_layers` (shared
embeddings, the stacked encoder, both final norms, an untied head) and whose `layers` are the
decoder layers one by one (the CPU-fast layout of `models/unrolled.py`).

Dimension letters: `B` rows, `T` step tokens (n decode rows first, then the chunk), `S` the
longest source a row holds, `R` sources encoded in one call, `E` d_model, `H` heads, `D`
head dim, `L` decoder layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.layers import AxesTable
from metrale_jax.models.m2m100 import (
    ATTENTION_AXES,
    FFN_AXES,
    M2M100_AXES,
    NORM_AXES,
    encoder_position_index,
    layer_norm,
    sinusoidal_embedding,
)
from metrale_jax.models.ragged import attend
from metrale_jax.models.unrolled import LayerParams

# Logical axes of one cross-attention buffer [B, S, H, D] (engine/sharding.py maps them).
CROSS_AXES: tuple[str | None, ...] = ("slots", None, "kv_heads", "head_dim")

DECODER_LAYER_AXES: AxesTable = {
    "self_attn_norm": NORM_AXES, "self_attn": ATTENTION_AXES, "cross_attn_norm": NORM_AXES,
    "cross_attn": ATTENTION_AXES, "ffn_norm": NORM_AXES, "ffn": FFN_AXES}

SEQ2SEQ_LAYER_PARAMS_AXES: AxesTable = {
    "outer": {k: v for k, v in M2M100_AXES.items() if k != "decoder_layers"},
    "layers": DECODER_LAYER_AXES,
}
"""Logical axes of an encoder-decoder's `LayerParams`, keyed by its fields."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CrossCache:
    """Every row's cross-attention keys and values: k, v L x `[B, S, H, D]`; lens `[B]`
    int32, the source length of each row (positions past it are not read)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lens: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, rows: int, length: int, dtype) -> CrossCache:
        """An empty cache of `rows` rows holding sources of up to `length` tokens."""
        shape = (rows, length, cfg.num_kv_heads, cfg.head_dim)
        L = cfg.num_layers
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(L)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(L)),
                   jnp.zeros((rows,), jnp.int32))

    @property
    def length(self) -> int:
        """S, the longest source a row holds."""
        return self.k[0].shape[1]


@dataclasses.dataclass(frozen=True)
class Seq2SeqGraph:
    """The static half of an encoder-decoder in the engine: its `ModelConfig` (the decoder
    view, `encoder_decoder` set), the model's graphdef and the graphdefs of one decoder layer
    and of the stacked encoder layers."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    layer_def: nnx.GraphDef
    encoder_def: nnx.GraphDef


def split_seq2seq(graphdef: nnx.GraphDef,
                  params: nnx.State) -> tuple[Seq2SeqGraph, LayerParams]:
    """A split `M2M100` (stacked params) -> (`Seq2SeqGraph`, `LayerParams`): the decoder
    layers one pytree each, everything else in `outer`."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    model = nnx.merge(graphdef, abstract)
    m2m = model.cfg
    layer_def = nnx.split(model.decoder_layers)[0]
    encoder_def = nnx.split(model.encoder_layers)[0]
    stacked = params["decoder_layers"]
    layers = tuple(jax.tree.map(lambda x, i=i: x[i], stacked)
                   for i in range(m2m.decoder_layers))
    outer = nnx.State({k: v for k, v in params.items() if k != "decoder_layers"})
    return Seq2SeqGraph(ModelConfig.for_m2m100(m2m), graphdef, layer_def, encoder_def), \
        LayerParams(outer, layers)


def _embed(graph: Seq2SeqGraph, params: LayerParams, tokens: jax.Array,
           table_index: jax.Array) -> jax.Array:
    """Scaled shared embeddings plus sinusoidal positions: tokens, table_index `[...]` ->
    `[..., E]` in the params dtype."""
    m2m = graph.cfg.encoder_decoder
    embed = params.outer["shared"][...]
    x = embed[tokens] * jnp.asarray(m2m.embed_scale, embed.dtype)
    pos = sinusoidal_embedding(table_index, m2m.d_model, m2m.pad_token_id)
    return x + pos.astype(x.dtype)


def head(graph: Seq2SeqGraph, params: LayerParams, x: jax.Array) -> jax.Array:
    """Decoder hidden states `[R, E]` -> logits `[R, V] float32` (final norm, tied or own
    head)."""
    m2m = graph.cfg.encoder_decoder
    norm = params.outer["decoder_norm"]
    x = layer_norm(x, norm["weight"][...], norm["bias"][...], m2m.layer_norm_eps)
    if m2m.tie_word_embeddings:
        out = jnp.einsum("re,ve->rv", x, params.outer["shared"][...])
    else:
        out = x @ params.outer["lm_head"][...]
    return out.astype(jnp.float32)


def ragged_layers(graph: Seq2SeqGraph, params: LayerParams, pages: tuple[jax.Array, ...],
                  tokens: jax.Array, positions: jax.Array, layout, cross: CrossCache,
                  token_rows: jax.Array, *, n: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The decoder over one ragged step's tokens (`models/ragged.py`'s layout), up to the
    final hidden states.

    tokens, positions: [T] int32 (decoder positions: the sinusoid index is
    `pad_token_id + 1 + position`); layout: the step's `StepLayout`; cross: every row's
    `CrossCache`; token_rows: [T] int32, each token's row (its cross-attention source); n:
    static, the decode rows (tokens 0 .. n-1 are rows 0 .. n-1). Returns the hidden states
    `[T, E]` (before the final norm) and the pools with this step's keys and values written.
    """
    m2m = graph.cfg.encoder_decoder
    x = _embed(graph, params, tokens, positions + m2m.pad_token_id + 1)
    new_pages = []
    for i, (state, pool) in enumerate(zip(params.layers, pages, strict=True)):
        x, pool = _ragged_decoder_layer(graph.layer_def, state, x, positions, pool, layout,
                                        cross.k[i], cross.v[i], cross.lens, token_rows, n=n)
        new_pages.append(pool)
    return x, tuple(new_pages)


def _project(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """x `[T, E]` @ w `[E, H, D]` + b `[H, D]` -> `[T, H, D]`."""
    return jnp.einsum("te,ehd->thd", x, w) + b


def _out(attn, out: jax.Array, dtype) -> jax.Array:
    """Attention output `[T, H, D]` -> `[T, E]` through o_proj and its bias."""
    T, H, D = out.shape
    return out.astype(dtype).reshape(T, H * D) @ attn.o_proj[...].reshape(H * D, -1) \
        + attn.o_bias[...]


def _cross_attention(attn, h: jax.Array, k: jax.Array, v: jax.Array,
                     lens: jax.Array) -> jax.Array:
    """Cross-attention of h `[T, E]` over its rows' sources k, v `[T, S, H, D]` (lens [T]:
    each row's source length) -> `[T, E]`; softmax in float32 as `MultiHeadAttention`."""
    q = _project(h, attn.q_proj[...], attn.q_bias[...])
    s = jnp.einsum("thd,tshd->ths", q, k.astype(q.dtype)).astype(jnp.float32) * attn.scale
    mask = jnp.arange(k.shape[1])[None, None, :] < lens[:, None, None]
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return _out(attn, jnp.einsum("ths,tshd->thd", p, v.astype(q.dtype)), h.dtype)


@functools.partial(jax.jit, static_argnames=("layer_def", "n"))
def _ragged_decoder_layer(layer_def, state, x, positions, pool, layout, cross_k, cross_v,
                          cross_lens, token_rows, *, n: int):
    """One pre-norm decoder layer over a ragged step: x [T, E] -> ([T, E], the pool written).
    cross_k, cross_v: this layer's `[B, S, H, D]`; cross_lens: [B]; token_rows: [T]."""
    layer = nnx.merge(layer_def, state)
    attn = layer.self_attn
    h = layer.self_attn_norm(x)
    q = _project(h, attn.q_proj[...], attn.q_bias[...])
    k = _project(h, attn.k_proj[...], attn.k_bias[...])
    v = _project(h, attn.v_proj[...], attn.v_bias[...])
    out, pool = attend(q, k, v, positions, pool, layout, n=n, sm_scale=attn.scale,
                       sliding_window=None, soft_cap=None)
    x = x + _out(attn, out, x.dtype)
    h = layer.cross_attn_norm(x)
    parts = []
    if n:  # decode rows read their own rows' sources
        parts.append(_cross_attention(layer.cross_attn, h[:n], cross_k[:n], cross_v[:n],
                                      cross_lens[:n]))
    if x.shape[0] > n:  # chunk tokens read their rows', gathered per token
        rows = token_rows[n:]
        parts.append(_cross_attention(layer.cross_attn, h[n:], cross_k[rows], cross_v[rows],
                                      cross_lens[rows]))
    x = x + (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
    return x + layer.ffn(layer.ffn_norm(x)), pool


def encoder_states(graph: Seq2SeqGraph, params: LayerParams, ids: jax.Array,
                   lens: jax.Array) -> jax.Array:
    """The encoder over R sources: ids [R, S'] int32, each source padded on the right (what
    lies past its length is ignored); lens: [R] int32, the real lengths. Returns the states
    after the final encoder layer norm, `[R, S', E]` (rows past a source's length: unused)."""
    m2m = graph.cfg.encoder_decoder
    S = ids.shape[1]
    mask = jnp.arange(S)[None, :] < lens[:, None]
    ids = jnp.where(mask, ids, m2m.pad_token_id)
    x = _embed(graph, params, ids, encoder_position_index(ids, m2m.pad_token_id))
    encoder_def = graph.encoder_def

    def body(x, state):
        return nnx.merge(encoder_def, state)(x, mask), None

    x, _ = jax.lax.scan(body, x, params.outer["encoder_layers"])
    norm = params.outer["encoder_norm"]
    return layer_norm(x, norm["weight"][...], norm["bias"][...], m2m.layer_norm_eps)


def encode_sources(graph: Seq2SeqGraph, params: LayerParams, cross: CrossCache,
                   rows: jax.Array, ids: jax.Array, lens: jax.Array) -> CrossCache:
    """The encoder over R sources and their cross-attention keys and values, written into
    their rows (cross donated).

    rows: [R] int32 (B = an unused entry: nothing written); ids: [R, S'] int32, each source
    padded on the right (S' a source bucket, at most `cross.length`); lens: [R] int32, the
    real lengths. Row r's buffers get positions 0 .. S'-1 and its length `lens[r]`.
    """
    S = ids.shape[1]
    enc = encoder_states(graph, params, ids, lens)
    new_k, new_v = [], []
    for i, state in enumerate(params.layers):
        k, v = nnx.merge(graph.layer_def, state).cross_attn.key_value(enc)
        new_k.append(cross.k[i].at[rows, :S].set(k.astype(cross.k[i].dtype), mode="drop"))
        new_v.append(cross.v[i].at[rows, :S].set(v.astype(cross.v[i].dtype), mode="drop"))
    return CrossCache(tuple(new_k), tuple(new_v), cross.lens.at[rows].set(lens, mode="drop"))


def copy_rows(cross: CrossCache, dst: jax.Array, src: jax.Array) -> CrossCache:
    """Row `dst[i]` takes row `src[i]`'s source (cross donated; dst [B] int32, B = unused):
    a forked beam of another row's request."""
    return CrossCache(tuple(a.at[dst].set(a[jnp.clip(src, 0, a.shape[0] - 1)], mode="drop")
                            for a in cross.k),
                      tuple(a.at[dst].set(a[jnp.clip(src, 0, a.shape[0] - 1)], mode="drop")
                            for a in cross.v),
                      cross.lens.at[dst].set(cross.lens[jnp.clip(src, 0, cross.lens.shape[0]
                                                                 - 1)], mode="drop"))


__all__ = ["CROSS_AXES", "SEQ2SEQ_LAYER_PARAMS_AXES", "CrossCache", "Seq2SeqGraph",
           "copy_rows", "encode_sources", "encoder_states", "head", "ragged_layers",
           "split_seq2seq"]
