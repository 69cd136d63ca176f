"""The params of the decoder-only transformer shared by Llama, Mistral, Qwen2/3 and Gemma 1/2.

`Transformer` stacks its layers (every layer parameter has a leading `L` axis): the layout
checkpoints load into and shard by (`TRANSFORMER_AXES`). The NNX module is split into a static
`graphdef` and a `params` pytree (`nnx.State`); the engine splits the params per layer
(`models/unrolled.py`) and passes them into every compiled step as an argument
(`models/ragged.py`), never closed over.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.layers import (
    ATTENTION_AXES,
    MLP,
    MLP_AXES,
    NORM_AXES,
    Attention,
    AxesTable,
    LoraDelta,
    RMSNorm,
    init_linear,
    stacked_axes,
    stacked_modules,
)
from metrale_jax.models.m2m100 import abstract_m2m100
from metrale_jax.models.moe import MOE_AXES, MoE
from metrale_jax.models.quant import quantize, quantizes_embeddings


class Block(nnx.Module):
    """One decoder layer's params: pre-norm attention and pre-norm MLP with residuals.

    Gemma 2 adds a norm after attention and after the MLP (`post_norms`). A mixture-of-experts
    model (`cfg.is_moe`) has `moe` (`models/moe.py`) in place of `mlp`. The attention itself
    runs in `models/ragged.py` (over the paged cache); `finish` is the rest of the layer.
    """

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        E, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.post_norms = cfg.post_norms
        self.attn_norm = RMSNorm(E, eps, off, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(E, eps, off, dtype)
        self.is_moe = cfg.is_moe
        if cfg.is_moe:
            self.moe = MoE(cfg, dtype, rngs)
        else:
            self.mlp = MLP(cfg, dtype, rngs)
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(E, eps, off, dtype)
            self.post_mlp_norm = RMSNorm(E, eps, off, dtype)

    def finish(self, x: jax.Array, h: jax.Array, lora: LoraDelta | None = None) -> jax.Array:
        """The layer after attention: x + post-norm(h), then the MLP residual. x, h: `[T, E]`
        (the input and the attention's projected output); lora: the MLP's adapter updates
        (`layers.LoraDelta`)."""
        return self.finish_routed(x, h, lora)[0]

    def finish_routed(self, x: jax.Array, h: jax.Array, lora: LoraDelta | None = None,
                      real: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """`finish`, and for a mixture-of-experts layer its tokens per expert `[X] int32`
        (counting the `real [T] bool` tokens; None for a dense layer)."""
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h
        counts = None
        if self.is_moe:
            h, counts = self.moe(self.mlp_norm(x), real)
        else:
            h = self.mlp(self.mlp_norm(x), lora)
        if self.post_norms:
            h = self.post_mlp_norm(h)
        return x + h, counts


# Logical axes of one Block's params (engine/sharding.py maps them to the mesh).
BLOCK_AXES: AxesTable = {
    "attn_norm": NORM_AXES, "attn": ATTENTION_AXES, "mlp_norm": NORM_AXES, "mlp": MLP_AXES,
    "moe": MOE_AXES,
    "post_attn_norm": NORM_AXES, "post_mlp_norm": NORM_AXES,
}


class Transformer(nnx.Module):
    """Embeddings, `L` stacked blocks, the final norm and the LM head (or tied embeddings):
    the params' layout, `embed [V, E]`, `blocks` (every leaf with a leading `L` axis),
    `final_norm`, `lm_head [E, V]` (absent when tied) and the int8 scales.

    The module defines and initializes the params; nothing calls it. The engine splits them per
    layer (`models/unrolled.py`) and runs them in ragged steps (`models/ragged.py`).
    """

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # int8 embeddings ("int8-all", "int4"): per-row scales `embed_scale [V]`, as the head's.
        quant_embed = quantizes_embeddings(cfg.quantization)
        init_linear(self, "embed", rngs, (cfg.vocab_size, cfg.hidden_size), 0, dtype, None)
        if quant_embed:
            q, scale = quantize(self.embed[...], (1,))
            self.embed, self.embed_scale = nnx.Param(q), nnx.Param(scale)
        self.blocks = stacked_modules(lambda r: Block(cfg, dtype, r), cfg.num_layers, rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)
        if not cfg.tie_word_embeddings:
            init_linear(self, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), 1, dtype,
                        "int8" if quant_embed else None)


# Logical axes of the whole model's params (`blocks` stacked over L), keyed like the params.
TRANSFORMER_AXES: AxesTable = {
    "embed": ("vocab", "embed"),        # [V, E]
    "blocks": stacked_axes(BLOCK_AXES),
    "final_norm": NORM_AXES,
    "lm_head": ("embed", "vocab"),      # [E, V]
    "embed_scale": ("vocab",),          # [V], int8 embed rows ("int8-all")
    "lm_head_scale": ("vocab",),        # [V], int8 lm_head columns ("int8-all")
}


def abstract_model(cfg: ModelConfig,
                   dtype: jnp.dtype = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The graphdef and a params pytree of `jax.ShapeDtypeStruct`s, allocating nothing (an
    encoder-decoder config: its `M2M100`'s)."""
    if cfg.encoder_decoder is not None:
        return abstract_m2m100(cfg.encoder_decoder, dtype)
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def rope_for_context(cfg: ModelConfig, graphdef: nnx.GraphDef,
                     max_len: int) -> tuple[ModelConfig, nnx.GraphDef]:
    """`(cfg, graphdef)` with LongRoPE's factor set chosen for contexts of `max_len`
    positions: the long factors only when `max_len` exceeds the scaling's
    `original_max_position_embeddings` (vLLM's rule with `max_model_len = max_len`; a paged
    cache keeps one rotation per key, so the choice is per engine, not per sequence). Any
    other config is returned as it is; the params do not change."""
    scaling = cfg.rope_scaling
    if scaling is None or scaling.kind != "longrope":
        return cfg, graphdef
    long = max_len > scaling.original_max_position_embeddings
    if long == scaling.long_context:
        return cfg, graphdef
    cfg = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(scaling, long_context=long))
    return cfg, abstract_model(cfg)[0]
