"""The same transformer with its layers unrolled over per-layer params: the CPU-fast layout.

`models.transformer.forward` scans over stacked `[L, ...]` params; on XLA:CPU every scan
iteration copies its layer's weights (and cache) out of the stacked arrays, which doubles the
memory traffic of a decode step. `LayerParams` holds one params pytree per layer instead, and
`forward_layers` / `decode_layers` run the layers as a Python loop (one compiled body per
layer), so each weight is read in place. The math is `Block` / `Attention`'s own.

Decode cache (`LayerCache`): one buffer per layer, keys transposed `[B, K, D, S]` and values
`[B, K, S, D]`, written in place by `decode_layers` (donate it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.kv_cache import KVCache
from metrale_jax.models.layers import AxesTable, embed_tokens, lm_logits, rms_norm
from metrale_jax.models.transformer import BLOCK_AXES, TRANSFORMER_AXES, Transformer

# Logical axes of LayerCache buffers (engine/sharding.py maps them to the mesh).
LAYER_KEY_AXES: tuple[str, ...] = ("slots", "kv_heads", "head_dim", "seq")
LAYER_VALUE_AXES: tuple[str, ...] = ("slots", "kv_heads", "seq", "head_dim")


# Logical axes of `LayerParams`, keyed by its fields (engine/sharding.py maps them to the mesh).
LAYER_PARAMS_AXES: AxesTable = {
    "outer": {k: v for k, v in TRANSFORMER_AXES.items() if k != "blocks"},
    "layers": BLOCK_AXES,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """The model's params with one pytree per layer.

    outer: the `Transformer` state with its `blocks` entry removed (embed, final norm, head);
    layers: L `Block` states (no leading L axis).
    """

    outer: nnx.State
    layers: tuple[nnx.State, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """Per-layer decode cache: kt L x `[B, K, D, S]` (keys transposed), v L x `[B, K, S, D]`."""

    kt: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, slots: int, length: int, dtype) -> LayerCache:
        K, D = cfg.num_kv_heads, cfg.head_dim
        return cls(tuple(jnp.zeros((slots, K, D, length), dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros((slots, K, length, D), dtype) for _ in range(cfg.num_layers)))

    @property
    def length(self) -> int:
        return self.v[0].shape[2]


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """The static half: the model's config, its graphdef and one block's graphdef."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    block_def: nnx.GraphDef


def split_layers(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[LayerGraph, LayerParams]:
    """Stacked params -> (static `LayerGraph`, `LayerParams`). Copies each layer's weights once."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    model = nnx.merge(graphdef, abstract)
    cfg = model.cfg
    block_def = nnx.split(model.blocks)[0]
    blocks = params["blocks"]
    layers = tuple(jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(cfg.num_layers))
    outer = nnx.State({k: v for k, v in params.items() if k != "blocks"})
    return LayerGraph(cfg, graphdef, block_def), LayerParams(outer, layers)


def _embed(graph: LayerGraph, params: LayerParams, tokens: jax.Array,
           images: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    scale = params.outer["embed_scale"][...] if "embed_scale" in params.outer else None
    return embed_tokens(graph.cfg, params.outer["embed"][...], tokens, images, scale)


def _head(graph: LayerGraph, params: LayerParams, x: jax.Array) -> jax.Array:
    """x: [..., E] -> logits [..., V] float32 (final norm, head, final softcap)."""
    cfg = graph.cfg
    x = rms_norm(x, params.outer["final_norm"]["weight"][...], cfg.rms_norm_eps,
                 cfg.norm_weight_offset)
    outer = params.outer
    head = None if cfg.tie_word_embeddings else outer["lm_head"][...]
    embed_scale = outer["embed_scale"][...] if "embed_scale" in outer else None
    head_scale = outer["lm_head_scale"][...] if "lm_head_scale" in outer else None
    return lm_logits(cfg, x, outer["embed"][...], head, embed_scale, head_scale)


def forward_layers(graph: LayerGraph, params: LayerParams, tokens: jax.Array,
                   positions: jax.Array, cache: KVCache | None = None,
                   logits_index: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """`models.transformer.forward` over `LayerParams`: same arguments, same results."""
    x = _embed(graph, params, tokens)
    new_k, new_v = [], []
    for i, (state, sliding) in enumerate(zip(params.layers, graph.cfg.layer_is_sliding,
                                             strict=True)):
        ck = None if cache is None else cache.k[i]
        cv = None if cache is None else cache.v[i]
        x, k, v = _prefill_layer(graph.block_def, state, x, positions, ck, cv,
                                 sliding=bool(sliding))
        new_k.append(k)
        new_v.append(v)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    logits = _head(graph, params, x)
    new_k, new_v = jnp.stack(new_k), jnp.stack(new_v)
    if cache is None:
        return logits, KVCache(new_k, new_v)
    return logits, cache.write(new_k, new_v, positions)


# One layer as its own jitted function: inside a compiled step, every layer with the same
# shapes reuses one traced body (JAX caches it), so tracing and lowering a 30-layer program
# costs about one layer, not thirty; XLA inlines the calls, so the compiled code is the same.
@functools.partial(jax.jit, static_argnames=("block_def", "sliding"))
def _prefill_layer(block_def, state, x, positions, cache_k, cache_v, *, sliding: bool):
    block = nnx.merge(block_def, state)
    return block(x, positions, cache_k, cache_v, jnp.asarray(sliding))


@functools.partial(jax.jit, static_argnames=("block_def", "sliding", "lengths"))
def _decode_layer(block_def, state, x, positions, cache_kt, cache_v, index, *, sliding: bool,
                  lengths: tuple[int, ...]):
    block = nnx.merge(block_def, state)
    return block.decode(x, positions, cache_kt, cache_v, sliding, index, lengths)


MIN_ATTENTION_LENGTH = 128


def attention_lengths(length: int) -> tuple[int, ...]:
    """The cache prefixes decode attention may read: powers of two from 128 below S, then S."""
    out, n = [], MIN_ATTENTION_LENGTH
    while n < length:
        out.append(n)
        n *= 2
    return (*out, length)


def decode_layers(graph: LayerGraph, params: LayerParams, tokens: jax.Array,
                  positions: jax.Array, cache: LayerCache,
                  active: jax.Array | None = None) -> tuple[jax.Array, LayerCache]:
    """One decode step of the first n slots: tokens [n] int32 at positions [n] int32 ->
    (logits [n, V] float32, cache with these tokens' keys and values written).

    cache: the full `[B, ...]` per-layer buffers (n ≤ B); active: [n] bool, the slots that
    hold a request: attention reads the cache only up to the largest active position.
    """
    lengths = attention_lengths(cache.length)
    live = positions if active is None else jnp.where(active, positions, 0)
    # The shortest prefix holding every active position (this token included).
    index = jnp.sum(jnp.asarray(lengths[:-1]) <= jnp.max(live)).astype(jnp.int32)
    x = _embed(graph, params, tokens[:, None])
    kts, vs = [], []
    for i, (state, sliding) in enumerate(zip(params.layers, graph.cfg.layer_is_sliding,
                                             strict=True)):
        x, kt, v = _decode_layer(graph.block_def, state, x, positions, cache.kt[i],
                                 cache.v[i], index, sliding=bool(sliding), lengths=lengths)
        kts.append(kt)
        vs.append(v)
    return _head(graph, params, x[:, 0]), LayerCache(tuple(kts), tuple(vs))


__all__ = ["LayerCache", "LayerGraph", "LayerParams", "Transformer", "decode_layers",
           "forward_layers", "split_layers"]
