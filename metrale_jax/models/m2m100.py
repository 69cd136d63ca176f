"""M2M100 / NLLB-200: the encoder-decoder translation transformer, as a Flax NNX model.

This is transformers' `M2M100ForConditionalGeneration` as NLLB-200 uses it: pre-norm encoder
and decoder layers (LayerNorm with bias), a final LayerNorm on each stack, sinusoidal position
embeddings with fairseq's padding offset (a token's embedding index is `pad_token_id + 1 +` its
position; a pad token gets the all-zero row `pad_token_id`), token embeddings shared by the
encoder, the decoder and the (tied) LM head and scaled by sqrt(d_model), bidirectional encoder
self-attention over a padding mask, causal decoder self-attention, decoder cross-attention
over the encoder output, and a ReLU (or GELU) feed-forward block.

Dimension letters: `V` vocab, `E` d_model, `F` ffn dim, `H` heads, `D` head dim (E // H),
`B` batch, `S` source length, `T` tokens, `L` layers. Parameters use the [in, out] layout
(`q_proj: [E, H, D]`, `o_proj: [H, D, E]`); each stack's layers are stacked `[L, ...]`.

Compute convention (as `models/layers.py`): activations in the params dtype; layer norms,
softmax and logits in float32.

The module holds the params and the layers' building blocks; the engine runs it through
`models/seq2seq_ragged.py` (the encoder once per request, `encode_sources`; the decoder in the
ragged paged steps, `ragged_layers`), which reads these params split per decoder layer.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.families.m2m100 import M2M100Config
from metrale_jax.models.layers import AxesTable, random_param, stacked_axes, stacked_modules

# ---- building blocks -----------------------------------------------------------------------

def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis: x `[..., E]`, weight and bias `[E]`; statistics and the
    affine map in float32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    """transformers' `ACT2FN[name]` for the supported names (see `families.m2m100.ACTIVATIONS`)."""
    if name == "relu":
        return jax.nn.relu(x)
    if name == "quick_gelu":  # CLIP's
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def sinusoidal_embedding(index: jax.Array, dim: int, padding_idx: int) -> jax.Array:
    """fairseq's sinusoidal table row for each table index: `index [...]` -> `[..., dim]`
    float32 (`[sin | cos]` halves; the row `padding_idx` is zeros), computed on the fly, so
    there is no length limit. Same formula and float32 steps as transformers'
    `M2M100SinusoidalPositionalEmbedding.get_embedding`."""
    half = dim // 2
    scale = np.float32(math.log(10000) / (half - 1))
    freqs = jnp.asarray(np.exp(np.arange(half, dtype=np.float32) * -scale).astype(np.float32))
    angles = index.astype(jnp.float32)[..., None] * freqs
    emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if dim % 2:
        emb = jnp.concatenate([emb, jnp.zeros((*emb.shape[:-1], 1), emb.dtype)], axis=-1)
    return jnp.where((index == padding_idx)[..., None], 0.0, emb)


def encoder_position_index(input_ids: jax.Array, padding_idx: int) -> jax.Array:
    """Sinusoid table index of each source token, as transformers'
    `create_position_ids_from_input_ids`: non-pad tokens count from `padding_idx + 1`, pads get
    `padding_idx`. input_ids `[B, S]` -> `[B, S] int32`."""
    mask = (input_ids != padding_idx).astype(jnp.int32)
    return jnp.cumsum(mask, axis=1) * mask + padding_idx


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias `[E]`: x `[..., E]` -> `[..., E]` (see `layer_norm`)."""

    def __init__(self, size: int, eps: float, dtype: Any):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.bias = nnx.Param(jnp.zeros((size,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention with biased q/k/v/o projections (`q_proj: [E, H, D]`, `q_bias:
    [H, D]`, ..., `o_proj: [H, D, E]`, `o_bias: [E]`); scores scaled by `D**-0.5`."""

    def __init__(self, d_model: int, heads: int, dtype: Any, rngs: nnx.Rngs):
        E, H, D = d_model, heads, d_model // heads
        self.q_proj = random_param(rngs, (E, H, D), dtype)
        self.k_proj = random_param(rngs, (E, H, D), dtype)
        self.v_proj = random_param(rngs, (E, H, D), dtype)
        self.o_proj = random_param(rngs, (H, D, E), dtype)
        self.q_bias = nnx.Param(jnp.zeros((H, D), dtype))
        self.k_bias = nnx.Param(jnp.zeros((H, D), dtype))
        self.v_bias = nnx.Param(jnp.zeros((H, D), dtype))
        self.o_bias = nnx.Param(jnp.zeros((E,), dtype))
        self.scale = D**-0.5

    def query(self, x: jax.Array) -> jax.Array:
        """x `[B, T, E]` -> q `[B, T, H, D]`."""
        return jnp.einsum("bte,ehd->bthd", x, self.q_proj[...]) + self.q_bias[...]

    def key_value(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x `[B, S, E]` -> k, v `[B, S, H, D]`."""
        k = jnp.einsum("bse,ehd->bshd", x, self.k_proj[...]) + self.k_bias[...]
        v = jnp.einsum("bse,ehd->bshd", x, self.v_proj[...]) + self.v_bias[...]
        return k, v

    def attend(self, q: jax.Array, keys: list[jax.Array], values: list[jax.Array],
               masks: list[jax.Array]) -> jax.Array:
        """Softmax attention of q `[B, T, H, D]` over key blocks `[B, S_i, H, D]`, each with its
        mask `[B, T, S_i]` (or broadcastable, True: may attend), as one softmax over all blocks.
        Returns the projected output `[B, T, E]`."""
        scores = [jnp.einsum("bthd,bshd->bhts", q, k) for k in keys]
        s = jnp.concatenate(scores, axis=-1).astype(jnp.float32) * self.scale
        mask = jnp.concatenate([jnp.broadcast_to(m, (*s.shape[:1], *s.shape[2:3], m.shape[-1]))
                                for m in masks], axis=-1)
        s = jnp.where(mask[:, None], s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        out, start = 0, 0
        for v in values:
            n = v.shape[1]
            out = out + jnp.einsum("bhts,bshd->bthd", p[..., start:start + n], v)
            start += n
        return jnp.einsum("bthd,hde->bte", out, self.o_proj[...]) + self.o_bias[...]


class FeedForward(nnx.Module):
    """`fc2(act(x @ fc1 + fc1_bias)) + fc2_bias`: x `[B, T, E]` -> `[B, T, E]`
    (`fc1: [E, F]`, `fc2: [F, E]`)."""

    def __init__(self, d_model: int, ffn_dim: int, act: str, dtype: Any, rngs: nnx.Rngs):
        self.act = act
        self.fc1 = random_param(rngs, (d_model, ffn_dim), dtype)
        self.fc1_bias = nnx.Param(jnp.zeros((ffn_dim,), dtype))
        self.fc2 = random_param(rngs, (ffn_dim, d_model), dtype)
        self.fc2_bias = nnx.Param(jnp.zeros((d_model,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = activation(self.act, x @ self.fc1[...] + self.fc1_bias[...])
        return h @ self.fc2[...] + self.fc2_bias[...]


class EncoderLayer(nnx.Module):
    """Pre-norm encoder layer: `x + attn(ln(x))`, then `x + ffn(ln(x))`."""

    def __init__(self, cfg: M2M100Config, dtype: Any, rngs: nnx.Rngs):
        E, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn_norm = LayerNorm(E, eps, dtype)
        self.self_attn = MultiHeadAttention(E, cfg.encoder_attention_heads, dtype, rngs)
        self.ffn_norm = LayerNorm(E, eps, dtype)
        self.ffn = FeedForward(E, cfg.encoder_ffn_dim, cfg.activation_function, dtype, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x `[B, S, E]`, mask `[B, S]` bool (True: a real token) -> `[B, S, E]`."""
        h = self.self_attn_norm(x)
        k, v = self.self_attn.key_value(h)
        x = x + self.self_attn.attend(self.self_attn.query(h), [k], [v], [mask[:, None, :]])
        return x + self.ffn(self.ffn_norm(x))


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer's blocks: causal self-attention, cross-attention, FFN, each
    residual (run over the engine's ragged steps by `seq2seq_ragged.ragged_layers`)."""

    def __init__(self, cfg: M2M100Config, dtype: Any, rngs: nnx.Rngs):
        E, eps = cfg.d_model, cfg.layer_norm_eps
        H = cfg.decoder_attention_heads
        self.self_attn_norm = LayerNorm(E, eps, dtype)
        self.self_attn = MultiHeadAttention(E, H, dtype, rngs)
        self.cross_attn_norm = LayerNorm(E, eps, dtype)
        self.cross_attn = MultiHeadAttention(E, H, dtype, rngs)
        self.ffn_norm = LayerNorm(E, eps, dtype)
        self.ffn = FeedForward(E, cfg.decoder_ffn_dim, cfg.activation_function, dtype, rngs)


# ---- the model -----------------------------------------------------------------------------

class M2M100(nnx.Module):
    """M2M100 / NLLB-200 for conditional generation: the params (see the module docstring;
    `seq2seq_ragged.split_seq2seq` splits them for the engine).

    Params (`nnx.to_pure_dict` keys): `shared [V, E]` (token embeddings of both stacks and,
    tied, the LM head), `lm_head [E, V]` (only when not tied), `encoder_layers` and
    `decoder_layers` (stacked `[L, ...]`), `encoder_norm`, `decoder_norm`.
    """

    def __init__(self, cfg: M2M100Config, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, V = cfg.d_model, cfg.vocab_size
        self.shared = random_param(rngs, (V, E), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = random_param(rngs, (E, V), dtype)
        self.encoder_layers = stacked_modules(lambda r: EncoderLayer(cfg, dtype, r),
                                              cfg.encoder_layers, rngs)
        self.encoder_norm = LayerNorm(E, cfg.layer_norm_eps, dtype)
        self.decoder_layers = stacked_modules(lambda r: DecoderLayer(cfg, dtype, r),
                                              cfg.decoder_layers, rngs)
        self.decoder_norm = LayerNorm(E, cfg.layer_norm_eps, dtype)


# ---- logical axes (engine/sharding.py's vocabulary) ----------------------------------------

NORM_AXES: AxesTable = {"weight": ("embed",), "bias": ("embed",)}
ATTENTION_AXES: AxesTable = {
    "q_proj": ("embed", "heads", "head_dim"), "k_proj": ("embed", "heads", "head_dim"),
    "v_proj": ("embed", "heads", "head_dim"), "o_proj": ("heads", "head_dim", "embed"),
    "q_bias": ("heads", "head_dim"), "k_bias": ("heads", "head_dim"),
    "v_bias": ("heads", "head_dim"), "o_bias": ("embed",),
}
FFN_AXES: AxesTable = {"fc1": ("embed", "mlp"), "fc1_bias": ("mlp",),
                       "fc2": ("mlp", "embed"), "fc2_bias": ("embed",)}
M2M100_AXES: AxesTable = {
    "shared": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "encoder_layers": stacked_axes({"self_attn_norm": NORM_AXES, "self_attn": ATTENTION_AXES,
                                    "ffn_norm": NORM_AXES, "ffn": FFN_AXES}),
    "encoder_norm": NORM_AXES,
    "decoder_layers": stacked_axes({"self_attn_norm": NORM_AXES, "self_attn": ATTENTION_AXES,
                                    "cross_attn_norm": NORM_AXES, "cross_attn": ATTENTION_AXES,
                                    "ffn_norm": NORM_AXES, "ffn": FFN_AXES}),
    "decoder_norm": NORM_AXES,
}
"""Logical axes of every M2M100 param, keyed like `nnx.to_pure_dict(params)`."""


def abstract_m2m100(cfg: M2M100Config,
                    dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The graphdef and a params pytree of `jax.ShapeDtypeStruct`s, allocating nothing."""
    model = nnx.eval_shape(lambda: M2M100(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)
