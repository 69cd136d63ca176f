"""The decoder-only transformer shared by Llama, Mistral, Qwen2/3 and Gemma 1/2.

`Transformer` stacks its layers (every layer parameter has a leading `L` axis) and runs them
with `jax.lax.scan`, so a 30-layer model compiles one layer body, not thirty.

The pure function the engine uses is `forward(graphdef, params, tokens, positions, cache)`:
the NNX module is split once into a static `graphdef` and a `params` pytree (`nnx.State`),
and the params go into every compiled step as an argument, never closed over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.kv_cache import KVCache
from metrale_jax.models.layers import (
    ATTENTION_AXES,
    MLP,
    MLP_AXES,
    NORM_AXES,
    Attention,
    AxesTable,
    RMSNorm,
    embed_tokens,
    init_linear,
    linear_weight,
    lm_logits,
    stacked_axes,
)
from metrale_jax.models.quant import quantizes_embeddings


class Block(nnx.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP with residuals.

    Gemma 2 adds a norm after attention and after the MLP (`post_norms`).
    """

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        E, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.post_norms = cfg.post_norms
        self.attn_norm = RMSNorm(E, eps, off, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(E, eps, off, dtype)
        self.mlp = MLP(cfg, dtype, rngs)
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(E, eps, off, dtype)
            self.post_mlp_norm = RMSNorm(E, eps, off, dtype)

    def __call__(self, x, positions, cache_k, cache_v, is_sliding):
        """x: [B, T, E] -> ([B, T, E], new keys [B, K, T, D], new values [B, K, T, D])."""
        h, k, v = self.attn(self.attn_norm(x), positions, cache_k, cache_v, is_sliding)
        return self._rest(x, h), k, v

    def _rest(self, x, h, lora=None):
        """The block after attention: x + post-norm(h), then the MLP residual (`lora`: the
        MLP's adapter updates, `layers.LoraDelta`)."""
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x), lora)
        if self.post_norms:
            h = self.post_mlp_norm(h)
        return x + h

    def decode(self, x, positions, cache_kt, cache_v, is_sliding: bool, length_index,
               lengths: tuple[int, ...]):
        """One decode step, x: [n, 1, E]; see `Attention.decode` for the per-layer cache."""
        h, cache_kt, cache_v = self.attn.decode(self.attn_norm(x), positions, cache_kt, cache_v,
                                                is_sliding, length_index, lengths)
        return self._rest(x, h), cache_kt, cache_v


# Logical axes of one Block's params (engine/sharding.py maps them to the mesh).
BLOCK_AXES: AxesTable = {
    "attn_norm": NORM_AXES, "attn": ATTENTION_AXES, "mlp_norm": NORM_AXES, "mlp": MLP_AXES,
    "post_attn_norm": NORM_AXES, "post_mlp_norm": NORM_AXES,
}


class Transformer(nnx.Module):
    """Embeddings, `L` stacked blocks, the final norm and the LM head (or tied embeddings).

    Call: `(tokens [B, T] int32, positions [B, T] int32, cache KVCache | None,
    logits_index [B] int32 | None) -> (logits, cache)`.
    - logits: `[B, T, V] float32`, or `[B, V]` at token `logits_index[b]` of each row when
      given (prefill needs only the last prompt token's logits).
    - cache: with a cache `[L, B, K, S, D]`, the same cache with this step's keys and values
      written at `positions`; without one, a cache of exactly these `T` tokens.
    """

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # int8 embeddings ("int8-all", "int4"): per-row scales `embed_scale [V]`, as the head's.
        quant_embed = quantizes_embeddings(cfg.quantization)
        init_linear(self, "embed", rngs, (cfg.vocab_size, cfg.hidden_size), 0, dtype, None)
        if quant_embed:
            from metrale_jax.models.quant import quantize
            q, scale = quantize(self.embed[...], (1,))
            self.embed, self.embed_scale = nnx.Param(q), nnx.Param(scale)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(r: nnx.Rngs) -> Block:
            return Block(cfg, dtype, r)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)
        if not cfg.tie_word_embeddings:
            init_linear(self, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), 1, dtype,
                        "int8" if quant_embed else None)

    def __call__(self, tokens, positions, cache: KVCache | None = None, logits_index=None):
        cfg = self.cfg
        embed, embed_scale = linear_weight(self, "embed")
        x = embed_tokens(cfg, embed, tokens, scale=embed_scale)
        sliding = jnp.asarray(cfg.layer_is_sliding)
        block_def, block_state = nnx.split(self.blocks)

        def body(x, layer):
            state, is_sliding, ck, cv = layer
            block = nnx.merge(block_def, state)
            x, k, v = block(x, positions, ck, cv, is_sliding)
            return x, (k, v)

        if cache is None:
            xs = (block_state, sliding, None, None)
        else:
            xs = (block_state, sliding, cache.k, cache.v)
        x, (new_k, new_v) = jax.lax.scan(body, x, xs)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        head, head_scale = (None, None) if cfg.tie_word_embeddings else \
            linear_weight(self, "lm_head")
        logits = lm_logits(cfg, self.final_norm(x), embed, head, embed_scale, head_scale)
        if cache is None:
            return logits, KVCache(new_k, new_v)
        return logits, cache.write(new_k, new_v, positions)


# Logical axes of the whole model's params (`blocks` stacked over L), keyed like the params.
TRANSFORMER_AXES: AxesTable = {
    "embed": ("vocab", "embed"),        # [V, E]
    "blocks": stacked_axes(BLOCK_AXES),
    "final_norm": NORM_AXES,
    "lm_head": ("embed", "vocab"),      # [E, V]
    "embed_scale": ("vocab",),          # [V], int8 embed rows ("int8-all")
    "lm_head_scale": ("vocab",),        # [V], int8 lm_head columns ("int8-all")
}


def split_model(model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
    """Splits a model into its static graph definition and its params pytree."""
    return nnx.split(model)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, logits_index: jax.Array | None = None):
    """The pure forward pass `(params, tokens, positions, cache) -> (logits, cache)`.

    Shapes as `Transformer.__call__`; `graphdef` is static (close over it or mark it static).
    """
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache, logits_index)


def abstract_model(cfg: ModelConfig,
                   dtype: jnp.dtype = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The graphdef and a params pytree of `jax.ShapeDtypeStruct`s, allocating nothing (an
    encoder-decoder config: its `M2M100`'s)."""
    if cfg.encoder_decoder is not None:
        from metrale_jax.models.m2m100 import abstract_m2m100
        return abstract_m2m100(cfg.encoder_decoder, dtype)
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)
